"""Expert parallelism (`expert_parallel`, engine/tp_layout.py): each rank's range of whole routed
experts and the sizes refused; the loader reads and expects only the rank's experts (per-expert
names and transformers' stacked form); and, in one process, each rank's partial output of a MoE
layer (its own experts, its share of the shared experts) summed over the ranks equals the
unsharded layer, each rank running only the experts it holds."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import loader
from engine.checkpoint_names import Piece, expected_pieces
from engine.config import EngineConfig, ModelConfig
from engine.loader import load_model
from engine.models.moe import Experts, SparseMoE
from engine.tp_layout import TPLayout
from engine.tp_ranks import layout_for
from pdcluster.cluster_config import ClusterConfig
from pdcluster.worker_launch import LaunchError, check_tensor_parallel


def _ep(rank: int, size: int, experts: int = 8, **kw) -> TPLayout:
    return TPLayout(rank, size, 4, 2, 16, 128, moe_intermediate_size=48, num_experts=experts,
                    expert_parallel=True, **kw)


def test_each_rank_holds_a_contiguous_range_of_whole_experts():
    assert [_ep(r, 4).experts for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    b = _ep(1, 2)
    assert b.experts == range(4, 8) and b.moe_inter == 48  # whole: not split by the intermediate size
    assert b.shard("layers.0.mlp.experts.gate_up_proj", 0) is None
    assert b.shard("layers.0.mlp.experts.down_proj", None) is None
    # attention and the dense MLP stay tensor-parallel
    assert b.shard("layers.0.self_attn.qkv_proj.weight", 0) == (0, 32, 32)
    assert b.shard("layers.0.mlp.down_proj.weight", None) == (1, 64, 64)
    assert "ep: experts 4-7 whole" in b.describe()
    # without it every rank holds every expert, split
    tp = TPLayout(1, 2, 4, 2, 16, 128, moe_intermediate_size=48, num_experts=8)
    assert tp.experts == range(8) and tp.moe_inter == 24 and "ep" not in tp.describe()


def test_expert_parallelism_does_not_need_the_experts_width_to_divide():
    assert TPLayout(0, 4, 4, 2, 16, 128, moe_intermediate_size=50, num_experts=8, expert_parallel=True).moe_inter == 50


@pytest.mark.parametrize("kwargs, match", [
    (dict(experts=6), "tensor_parallel_size 4 must divide the model's 6 routed experts"),
    (dict(experts=0), "needs a mixture-of-experts model"),
])
def test_sizes_and_models_expert_parallelism_cannot_split_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _ep(0, 4, **kwargs)


def test_dense_models_are_refused_and_gpt_oss_keeps_its_stacked_experts(checkpoint):
    dense = ModelConfig.from_pretrained(checkpoint("llama-gqa"))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        layout_for(dense, 0, 1, expert_parallel=True)  # a mistake even where it would change nothing
    gpt_oss = ModelConfig.from_pretrained(checkpoint("gpt-oss"))
    ep = layout_for(gpt_oss, 1, 2, expert_parallel=True)
    assert ep.stacked_experts and ep.experts == range(2, 4)
    assert ep.shard("layers.0.mlp.experts.down_proj_bias", None) == (0, 2, 2)  # its experts' rows, biases too
    tp = layout_for(gpt_oss, 1, 2)
    i = gpt_oss.moe_intermediate_size // 2
    assert tp.shard("layers.0.mlp.experts.gate_up_proj", None) == (2, 2 * i, 2 * i)  # gate/up pairs together
    assert tp.shard("layers.0.mlp.experts.down_proj", None) == (1, i, i)
    assert tp.shard("layers.0.mlp.experts.down_proj_bias", None) is None  # whole, and zeros on rank 1:
    assert tp.zeroed("layers.0.mlp.experts.down_proj_bias") and tp.zeroed("layers.0.self_attn.o_proj.bias")
    assert not layout_for(gpt_oss, 0, 2).zeroed("layers.0.self_attn.o_proj.bias")  # rank 0 adds them
    assert not ep.zeroed("layers.0.mlp.experts.down_proj_bias")  # an EP rank's whole experts keep theirs
    assert ep.zeroed("layers.0.self_attn.o_proj.bias")  # attention stays tensor-parallel under EP
    assert tp.shard("layers.0.self_attn.sinks", None) == (0, 2, 2)
    moe = ModelConfig.from_pretrained(checkpoint("qwen3-moe"))
    assert not layout_for(moe, 0, 1, expert_parallel=True).expert_parallel  # one rank: a no-op
    with pytest.raises(ValueError, match="expert_parallel must be true or false"):
        EngineConfig(expert_parallel="yes")


def test_a_rank_expects_only_its_experts():
    got = expected_pieces({"layers.0.mlp.experts.down_proj": range(4, 8), "layers.0.mlp.gate.weight": 0})
    assert got == {Piece("layers.0.mlp.gate.weight")} | {Piece("layers.0.mlp.experts.down_proj", None, e)
                                                           for e in range(4, 8)}


def _copy_without(src, dst, drop: str) -> None:
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if drop not in k}
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_the_loader_reads_and_requires_only_the_ranks_experts(checkpoint, tmp_path, monkeypatch):
    src = checkpoint("qwen3-moe")  # 8 experts per layer, named one by one
    cfg = ModelConfig.from_pretrained(src)
    read: list[str] = []
    real = loader._read

    def recorded(f, name, *args, **kwargs):
        read.append(name)
        yield from real(f, name, *args, **kwargs)

    monkeypatch.setattr(loader, "_read", recorded)
    model = load_model(cfg, torch.float32, torch.device("cpu"), 64, pack=False, layout=layout_for(cfg, 1, 2, True))
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == {4, 5, 6, 7}  # the other rank's were never read
    assert tuple(model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 2 * 64, 64)  # E/N whole experts
    # a checkpoint without expert 2 serves rank 1 (experts 4-7) but not rank 0, which names what it misses
    _copy_without(src, tmp_path, "mlp.experts.2.")
    broken = ModelConfig.from_pretrained(tmp_path)
    load_model(broken, torch.float32, torch.device("cpu"), 64, pack=False, layout=layout_for(broken, 1, 2, True))
    with pytest.raises(ValueError, match=r"missing tensors: \['layers.0.mlp.experts.down_proj\[2\]"):
        load_model(broken, torch.float32, torch.device("cpu"), 64, pack=False, layout=layout_for(broken, 0, 2, True))


def _stacked(src, dst) -> None:
    """The checkpoint in transformers' stacked form: (E, 2I, H) and (E, H, I) per layer."""
    tensors = load_file(src / "model.safetensors")
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        pre = f"model.layers.{layer}.mlp.experts"
        out[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{pre}.{e}.gate_proj.weight"], tensors[f"{pre}.{e}.up_proj.weight"]]) for e in range(8)])
        out[f"{pre}.down_proj"] = torch.stack([tensors[f"{pre}.{e}.down_proj.weight"] for e in range(8)])
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})


def test_a_stacked_checkpoint_is_sliced_on_the_expert_dim(checkpoint, tmp_path):
    src = checkpoint("qwen3-moe")
    _stacked(src, tmp_path)
    per_expert = ModelConfig.from_pretrained(src)
    stacked = ModelConfig.from_pretrained(tmp_path)
    for rank in range(2):
        a = load_model(per_expert, torch.float32, torch.device("cpu"), 64, pack=False,
                       layout=layout_for(per_expert, rank, 2, True))
        b = load_model(stacked, torch.float32, torch.device("cpu"), 64, pack=False,
                       layout=layout_for(stacked, rank, 2, True))
        for name in ("gate_up_proj", "down_proj"):
            x, y = getattr(a.layers[1].mlp.experts, name), getattr(b.layers[1].mlp.experts, name)
            assert x.shape[0] == 4 and torch.equal(x, y)


@pytest.mark.parametrize("shape", ["qwen3-moe", "mixtral", "deepseek-v3"])
@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_partial_outputs_sum_to_the_unsharded_layer(checkpoint, monkeypatch, shape, size):
    """Each rank runs only its own experts on the tokens routed to them; the sum over the ranks
    (what the all-reduce computes), the shared experts' TP shares included, is the whole layer."""
    cfg = ModelConfig.from_pretrained(checkpoint(shape))
    if cfg.num_experts % size:
        pytest.skip(f"{cfg.num_experts} experts over {size} ranks")
    layer = max(cfg.moe_layers)
    whole = load_model(cfg, torch.float32, torch.device("cpu"), 64, pack=False).layers[layer].mlp
    ranks = [load_model(cfg, torch.float32, torch.device("cpu"), 64, pack=False,
                        layout=layout_for(cfg, r, size, True)).layers[layer].mlp for r in range(size)]
    assert all(isinstance(m, SparseMoE) for m in [whole, *ranks])
    torch.manual_seed(0)
    x = torch.randn(23, cfg.hidden_size)
    ids = whole.gate(x)[0]
    runs: list[tuple[int, int, int]] = []  # (which module, its expert index, rows)
    run = Experts.run

    def counted(self, expert, rows):
        runs.append((id(self), expert, len(rows)))
        return run(self, expert, rows)

    monkeypatch.setattr(Experts, "run", counted)
    with torch.no_grad():
        want = whole(x)
        parts = [m(x) for m in ranks]
    torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-5)
    assert all(not torch.allclose(p, want, atol=1e-3) for p in parts)  # each rank's is partial
    per = cfg.num_experts // size
    for r, m in enumerate(ranks):
        held = range(r * per, (r + 1) * per)
        assert m.experts.gate_up_proj.shape[0] == per  # memory: E/N whole experts
        mine = [(e + held.start, n) for who, e, n in runs if who == id(m.experts)]
        assert {e for e, _ in mine} == {e for e in ids.flatten().tolist() if e in held}  # its own, no other
        assert sum(n for _, n in mine) == sum(int((ids == e).sum()) for e in held)  # each pair once
    assert sum(n for who, _, n in runs if who != id(whole.experts)) == ids.numel()  # every pair, on one rank


def test_cluster_yaml_pools_pass_it_on_and_up_refuses_what_cannot_split(checkpoint):
    def cfg(path, **pool):
        return ClusterConfig.from_dict({"model": {"path": str(path)}, "pools": [
            {"name": "p", "role": "prefill"}, {"name": "d", "role": "decode", **pool}]})

    moe = checkpoint("qwen3-moe")
    c = cfg(moe, tensor_parallel_size=2, expert_parallel=True)
    assert c.engine_kwargs(c.pools[1])["expert_parallel"] is True
    assert c.engine_kwargs(c.pools[0])["expert_parallel"] is False
    EngineConfig(**c.engine_kwargs(c.pools[1]))
    check_tensor_parallel(c)
    with pytest.raises(LaunchError, match=r"pools\[1\].expert_parallel \(pool 'd'\): expert_parallel: "
                                          r"tensor_parallel_size 4 must divide the model's 6 routed experts"):
        check_tensor_parallel(cfg(checkpoint("qwen3-moe-dense-first"), tensor_parallel_size=4, expert_parallel=True))
    with pytest.raises(LaunchError, match=r"pools\[1\].expert_parallel .*needs a mixture-of-experts model"):
        check_tensor_parallel(cfg(checkpoint("llama-gqa"), expert_parallel=True))


def test_the_planner_writes_expert_parallel_pools_the_engine_can_serve():
    """An EP pool of a plan becomes `expert_parallel: true` beside its tensor_parallel_size, a
    cluster.yaml the schema accepts; the header says how the engine's EP differs from the plan's, or
    why the pool cannot be served as written."""
    from planner.catalog import load_catalog
    from planner.cli import ep_header
    from planner.models import PRESETS
    from planner.plan import Plan, PlanContext, Pool
    from planner.report import cluster_dict
    from planner.search import SLOTarget

    ctx = PlanContext(PRESETS["DeepSeek-V3"], load_catalog())
    plan = Plan("disaggregated", Pool("H200", 1, tp=8), Pool("H200", 2, tp=8, ep=True))
    cfg = ClusterConfig.from_dict(cluster_dict(plan, ctx, SLOTarget(1000, 50), "/models/deepseek-v3", 3000))
    assert [(p.tensor_parallel_size, p.expert_parallel) for p in cfg.pools] == [(8, False), (8, True)]
    assert cfg.engine_kwargs(cfg.pools[1])["expert_parallel"] is True
    assert "attention tensor-parallel and combines with an all-reduce" in ep_header(plan.decode, ctx)
    assert "not servable as written: ep16 spans 2 nodes" in ep_header(Pool("H100-SXM", 1, tp=16, ep=True), ctx)
    oss = PlanContext(PRESETS["gpt-oss-120b"], load_catalog())
    assert "not servable" not in ep_header(Pool("H200", 1, tp=4, ep=True), oss)
