"""Linear layers on oneDNN with prepacked weights equal torch's, and the dtype "auto" resolves as
documented (the checkpoint's, float32 on a CPU without native bf16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig, ModelConfig, checkpoint_dtype, cpu_has_native
from engine.loader import load_model
from engine.native import native_lib
from engine.packed_linear import TILE_MAX_ROWS, PackedLinear, can_pack, pack_linears
from pdcluster import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 64, 300])
def test_packed_linear_equals_torch(rows, bias):
    torch.manual_seed(rows)
    ref = nn.Linear(96, 203, bias=bias)
    x = torch.randn(rows, 96)
    packed = PackedLinear(ref)  # one reordered weight serves every batch size
    torch.testing.assert_close(packed(x), ref(x), atol=1e-5, rtol=1e-5)
    wide = torch.randn(rows, 192)[:, ::2]  # a strided input
    torch.testing.assert_close(packed(wide), ref(wide), atol=1e-5, rtol=1e-5)


def test_pack_linears_swaps_every_linear_of_the_model(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint("llama-gqa"))
    model = load_model(cfg, torch.float32, torch.device("cpu"), 64)
    kinds = {type(m) for m in model.modules()}
    assert PackedLinear in kinds and nn.Linear not in kinds
    assert pack_linears(model) == 0  # nothing left to pack
    plain = load_model(cfg, torch.float32, torch.device("cpu"), 64, pack=False)
    assert PackedLinear not in {type(m) for m in plain.modules()}


def test_tied_embedding_stays_a_plain_table(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint("llama-mqa-tied"))
    assert cfg.tie_word_embeddings
    model = load_model(cfg, torch.float32, torch.device("cpu"), 64)
    assert isinstance(model.lm_head, PackedLinear) and not model.embed_tokens.weight.is_mkldnn
    ids = torch.tensor([5, 9])
    plain = load_model(cfg, torch.float32, torch.device("cpu"), 64, pack=False)
    h = plain.embed_tokens(ids)
    torch.testing.assert_close(model.compute_logits(h), plain.compute_logits(h), atol=1e-4, rtol=1e-5)


def test_bf16_packs_only_where_the_cpu_has_it(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint("llama-gqa"))
    model = load_model(cfg, torch.bfloat16, torch.device("cpu"), 64)
    packed = isinstance(model.lm_head, PackedLinear)
    assert packed == cpu_has_native(torch.bfloat16)  # emulated bf16 keeps torch's own nn.Linear
    assert not can_pack(torch.device("meta"), torch.float32)
    assert not can_pack(torch.device("cpu"), torch.float16)  # not packed: oneDNN reorder is bf16/fp32 here


def test_eager_and_packed_engines_give_the_same_tokens(checkpoint):
    path = str(checkpoint("llama-gqa"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 30, 61)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fast_llm = LLM(path, num_blocks=64, max_model_len=128)
    # the default engine is the fast one: prepacked linears and, with a compiler here, the native decode
    assert isinstance(fast_llm.engine.runner.model.lm_head, PackedLinear)
    assert fast_llm.engine.runner.native_decode == (native_lib() is not None)
    fast = fast_llm.generate(prompts, sp)
    eager_llm = LLM(path, num_blocks=64, max_model_len=128, enforce_eager=True)
    assert not any(isinstance(m, PackedLinear) for m in eager_llm.engine.runner.model.modules())
    assert not eager_llm.engine.runner.native_decode
    eager = eager_llm.generate(prompts, sp)
    assert [o.token_ids for o in fast] == [o.token_ids for o in eager]


def test_auto_dtype_is_the_checkpoints_unless_the_cpu_lacks_it(checkpoint):
    f32 = ModelConfig.from_pretrained(checkpoint("llama-gqa"))
    bf16 = ModelConfig.from_pretrained(checkpoint("llama-gqa", dtype=torch.bfloat16))
    assert checkpoint_dtype(f32.hf_config) == torch.float32
    assert checkpoint_dtype(bf16.hf_config) == torch.bfloat16
    auto = EngineConfig(device="cpu")
    assert auto.dtype == "auto"
    assert auto.torch_dtype(f32) == torch.float32
    assert auto.torch_dtype(bf16) == (torch.bfloat16 if cpu_has_native(torch.bfloat16) else torch.float32)
    assert EngineConfig(device="cpu", dtype="bfloat16").torch_dtype(f32) == torch.bfloat16  # asked for: kept
    with pytest.raises(ValueError, match="'auto'"):
        EngineConfig(dtype="fp8")


LIB = native_lib()
AMX = LIB is not None and bool(LIB.pd_amx_ready()) and can_pack(torch.device("cpu"), torch.bfloat16)


class _CountingTiles:
    """The native library, counting the tile linear's calls."""

    def __init__(self, lib) -> None:
        self.lib, self.calls = lib, 0

    def pd_linear_bf16(self, *args):
        self.calls += 1
        return self.lib.pd_linear_bf16(*args)


@pytest.mark.skipif(not AMX, reason="decode copies need AMX tiles")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 23, TILE_MAX_ROWS, TILE_MAX_ROWS + 1])
def test_decode_tiles_equal_onednn_bit_for_bit(rows, bias):
    """Up to TILE_MAX_ROWS rows a bfloat16 layer runs on its tile copy: the same sums in the same
    order as oneDNN's, so the same bits (208 outputs: a last column group of one tile); past it,
    oneDNN runs."""
    torch.manual_seed(rows)
    ref = nn.Linear(320, 208, bias=bias).to(torch.bfloat16)
    counting = _CountingTiles(LIB)
    onednn, tiles = PackedLinear(ref), PackedLinear(ref, counting)
    assert onednn.tiles is None and tiles.tiles is not None
    x = torch.randn(rows, 320).to(torch.bfloat16)
    wide = torch.randn(rows, 640).to(torch.bfloat16)[:, 160:480]  # rows of a wider tensor, read in place
    with torch.no_grad():
        assert torch.equal(tiles(x), onednn(x)) and torch.equal(tiles(wide), onednn(wide))
    assert counting.calls == (2 if rows <= TILE_MAX_ROWS else 0)


@pytest.mark.skipif(not AMX, reason="decode copies need AMX tiles")
def test_bf16_model_keeps_decode_copies_but_not_of_the_lm_head(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint("llama-gqa"))
    model = load_model(cfg, torch.bfloat16, torch.device("cpu"), 64)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert model.lm_head.tiles is None and any(m.tiles is not None for m in linears)
    assert all(m.tiles is not None for m in linears if m is not model.lm_head and m.in_features % 32 == 0
               and m.out_features % 16 == 0)
