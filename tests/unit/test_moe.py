"""Mixture-of-experts models (engine/models/moe.py): checkpoint names, the stacked form transformers
writes in memory, which layers route, each expert sharded by tensor parallelism, and a step that
runs only the experts its tokens were routed to."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint_names import Piece, piece_of
from engine.config import ModelConfig
from engine.models.moe import Experts
from engine.tp_layout import TPLayout
from pdcluster import LLM, SamplingParams
from tests.reference import hf_greedy


@pytest.mark.parametrize("name, piece", [
    ("model.layers.3.block_sparse_moe.experts.5.w1.weight", Piece("layers.3.mlp.experts.gate_up_proj", 0, 5)),
    ("model.layers.3.block_sparse_moe.experts.5.w3.weight", Piece("layers.3.mlp.experts.gate_up_proj", 1, 5)),
    ("model.layers.3.block_sparse_moe.experts.5.w2.weight", Piece("layers.3.mlp.experts.down_proj", None, 5)),
    ("model.layers.3.block_sparse_moe.gate.weight", Piece("layers.3.mlp.gate.weight")),
    ("model.layers.0.mlp.experts.12.gate_proj.weight", Piece("layers.0.mlp.experts.gate_up_proj", 0, 12)),
    ("model.layers.0.mlp.experts.12.up_proj.weight", Piece("layers.0.mlp.experts.gate_up_proj", 1, 12)),
    ("model.layers.0.mlp.experts.12.down_proj.weight", Piece("layers.0.mlp.experts.down_proj", None, 12)),
    ("model.layers.0.mlp.experts.gate_up_proj", Piece("layers.0.mlp.experts.gate_up_proj")),  # stacked
    ("model.layers.0.mlp.gate_proj.weight", Piece("layers.0.mlp.gate_up_proj.weight", 0)),  # a dense layer
    ("model.layers.0.mlp.gate.weight", Piece("layers.0.mlp.gate.weight")),
])
def test_checkpoint_names_of_experts(name, piece):
    assert piece_of(name) == piece


def test_which_layers_route(checkpoint):
    mixtral = ModelConfig.from_pretrained(checkpoint("mixtral"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_layers) == (4, 2, frozenset({0, 1}))
    dense_first = ModelConfig.from_pretrained(checkpoint("qwen3-moe-dense-first"))
    assert dense_first.moe_layers == frozenset({1}) and not dense_first.norm_topk_prob
    assert dense_first.moe_intermediate_size == 48 and dense_first.qk_norm
    every_other = ModelConfig.from_pretrained(checkpoint("qwen3-moe", num_hidden_layers=4, decoder_sparse_step=2))
    assert every_other.moe_layers == frozenset({1, 3})
    assert ModelConfig.from_pretrained(checkpoint("llama-gqa")).moe_layers == frozenset()


def test_each_expert_is_sharded_by_tensor_parallelism():
    layout = TPLayout(1, 2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=48)
    assert layout.moe_inter == 24
    assert layout.shard("layers.0.mlp.experts.gate_up_proj", 0) == (0, 24, 24)
    assert layout.shard("layers.0.mlp.experts.gate_up_proj", 1) == (0, 24, 24)
    assert layout.shard("layers.0.mlp.experts.down_proj", None) == (1, 24, 24)
    assert layout.shard("layers.0.mlp.gate.weight", None) is None  # the router: whole on every rank
    with pytest.raises(ValueError, match="experts' intermediate size 50"):
        TPLayout(0, 4, 4, 2, 16, 128, moe_intermediate_size=50)


def test_the_stacked_form_loads_like_the_per_expert_form(checkpoint, tmp_path):
    """transformers' in-memory names (one (E, 2I, H) and one (E, H, I) tensor per layer) load too."""
    src = checkpoint("qwen3-moe")
    tensors = load_file(src / "model.safetensors")
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        pre = f"model.layers.{layer}.mlp.experts"
        experts = range(8)
        stacked[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{pre}.{e}.gate_proj.weight"], tensors[f"{pre}.{e}.up_proj.weight"]]) for e in experts])
        stacked[f"{pre}.down_proj"] = torch.stack([tensors[f"{pre}.{e}.down_proj.weight"] for e in experts])
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(stacked, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompt = list(range(5, 40))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = LLM(str(tmp_path), num_blocks=32, max_model_len=128).generate([prompt], params)[0].token_ids
    assert got == hf_greedy(str(src))(prompt, 12)


def test_a_decode_step_runs_only_the_routed_experts(checkpoint, monkeypatch):
    """Batch 1, top-2 of 8: two experts' weights per routed layer and token, never all eight."""
    calls: list[int] = []
    run = Experts.run

    def counted(self, expert, x):
        calls.append(len(x))
        return run(self, expert, x)

    # enforce_eager: torch's path, one expert at a time (the native kernel's reads are checked below)
    llm = LLM(str(checkpoint("qwen3-moe")), num_blocks=32, max_model_len=128, mode="colocated", enforce_eager=True)
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=1, temperature=0.0))  # warm
    monkeypatch.setattr(Experts, "run", counted)
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # the prompt (5 tokens, at most 5 x 2 expert choices per layer) then 2 decode steps of one token
    prefill, decode = calls[:-8], calls[-8:]
    assert decode == [1] * 8  # 2 steps x 2 layers x top-2, each expert on its one token
    assert sum(prefill) == 5 * 2 * 2 and len(prefill) <= 2 * 8


@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3"])
def test_the_native_experts_kernel_computes_what_torch_does_and_reads_only_chosen_experts(checkpoint, name):
    """engine/csrc/moe_experts.c against the per-expert torch path, at 1 to 40 rows (1 to 4 rows per
    pass over a weight row, scalar tails); every expert no token chose has NaN weights, so a read of
    one would show."""
    from engine.builtin_model import resolve_model_path
    from engine.loader import load_model
    from engine.models.moe import dispatch

    cfg = ModelConfig.from_pretrained(resolve_model_path(str(checkpoint(name))))
    model = load_model(cfg, torch.float32, torch.device("cpu"), 128)
    layer = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
    experts = layer.experts
    assert experts.native is not None, "the native kernels did not build"
    torch.manual_seed(0)
    for rows in (1, 2, 3, 5, 9, 40):
        x = torch.randn(rows, cfg.hidden_size)
        with torch.no_grad():
            ids, weights = layer.gate(x)
            want = dispatch(x, ids, weights, cfg.num_experts, experts.run)
            unchosen = sorted(set(range(cfg.num_experts)) - set(ids.flatten().tolist()))
            saved = experts.gate_up_proj.data[unchosen].clone(), experts.down_proj.data[unchosen].clone()
            experts.gate_up_proj.data[unchosen] = float("nan")
            experts.down_proj.data[unchosen] = float("nan")
            try:
                got = experts(x, ids, weights, cfg.num_experts)
            finally:
                experts.gate_up_proj.data[unchosen], experts.down_proj.data[unchosen] = saved
        if rows * ids.shape[1] < 12 * cfg.num_experts:  # the native kernel's range (see moe.py)
            assert torch.isfinite(got).all(), f"{rows} rows: an unchosen expert was read"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_native_experts_kernel_runs_only_the_experts_a_rank_holds(checkpoint):
    """Expert parallelism: a rank holding experts [E/2, E) sums only their pairs, like torch's path."""
    from engine.builtin_model import resolve_model_path
    from engine.loader import load_model
    from engine.models.moe import dispatch

    cfg = ModelConfig.from_pretrained(resolve_model_path(str(checkpoint("qwen3-moe"))))
    layer = next(layer.mlp for layer in load_model(cfg, torch.float32, torch.device("cpu"), 128).layers
                 if hasattr(layer.mlp, "experts"))
    E = cfg.num_experts
    held = range(E // 2, E)
    half = Experts(len(held), cfg.hidden_size, layer.experts.inter)
    half.gate_up_proj.data = layer.experts.gate_up_proj.data[held.start:].clone()
    half.down_proj.data = layer.experts.down_proj.data[held.start:].clone()
    half.native = layer.experts.native
    torch.manual_seed(1)
    x = torch.randn(6, cfg.hidden_size)
    with torch.no_grad():
        ids, weights = layer.gate(x)
        got = half(x, ids, weights, E, held)
        want = dispatch(x, ids, weights, E, half.run, held)
        whole = layer.experts(x, ids, weights, E)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, whole)  # the other half's experts are not in it
