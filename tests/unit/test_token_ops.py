"""The native per-token kernels (engine/csrc/token_ops.c, router.c) against the torch code they
replace: RMSNorm (with the residual add folded in), RoPE (after Qwen3's per-head norms), and the
softmax router."""

from __future__ import annotations

import pytest
import torch

from engine import token_ops
from engine.config import ModelConfig
from engine.models.moe import Router
from engine.models.norm import RMSNorm
from engine.native import native_lib
from engine.rope import apply_rope

lib = native_lib()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the native kernels")
DTYPES = [torch.float32, torch.bfloat16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of the dtype's epsilon at b's largest magnitude."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() / torch.finfo(a.dtype).eps


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    n = RMSNorm(dim, 1e-6).to(dtype)
    n.weight.data = torch.randn(dim).to(dtype)
    return n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 700])
def test_rms_norm_matches_torch(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    n = _norm(96, dtype)
    x = (torch.randn(rows, 104) * 3).to(dtype)[:, :96]  # strided rows, as a slice of a wider output
    delta = torch.randn(rows, 96).to(dtype)
    with torch.no_grad():
        want, want_sum = n(x), n(x + delta)
        n.token_ops = lib
        got, (got_sum_norm, total) = n(x), n.after_add(x, delta)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(total, x + delta)  # the residual add rounds as torch's
    # the only difference is the order a row's squares are summed in: an ulp of the scale, no more
    assert _ulps(got, want) <= 4 and _ulps(got_sum_norm, want_sum) <= 4
    if dtype == torch.bfloat16 and rows < 100:
        assert torch.equal(got, want)  # rounded to bfloat16, a few rows agree bit for bit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_matches_torch(dtype: torch.dtype, qk_norm: bool) -> None:
    torch.manual_seed(1)
    T, q_heads, kv_heads, hd = 9, 4, 2, 32
    qkv = torch.randn(T, (q_heads + 2 * kv_heads) * hd).to(dtype)
    heads = qkv[:, :(q_heads + kv_heads) * hd].view(T, -1, hd)  # strided tokens, as Attention slices them
    angles = torch.randn(T, hd // 2)
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    qn, kn = _norm(hd, dtype), _norm(hd, dtype)
    with torch.no_grad():
        if qk_norm:
            want = apply_rope(torch.cat([qn(heads[:, :q_heads].reshape(T, q_heads, hd)),
                                         kn(heads[:, q_heads:].reshape(T, kv_heads, hd))], dim=1), cos, sin)
            got = token_ops.rope(lib, heads, cos, sin, qn.weight, kn.weight, q_heads, 1e-6)
        else:
            want = apply_rope(heads, cos, sin)
            got = token_ops.rope(lib, heads, cos, sin)
    assert got is not None and got.is_contiguous()
    if qk_norm:
        assert _ulps(got, want) <= 4
    else:
        assert torch.equal(got, want)  # the same products, rounded alike: bit for bit
    wide = torch.zeros(T, q_heads + kv_heads, hd + 16, dtype=dtype)  # into the tail of wider heads, as MLA's q rows
    with torch.no_grad():
        into = token_ops.rope(lib, heads, cos, sin, qn.weight if qk_norm else None, kn.weight if qk_norm else None,
                              q_heads, 1e-6, out=wide[..., 16:])
    assert into is not None and torch.equal(wide[..., 16:], got) and not wide[..., :16].any()


def test_kernels_decline_what_they_do_not_read() -> None:
    x = torch.randn(3, 8, dtype=torch.float16)
    assert token_ops.rms_norm(lib, x, torch.ones(8, dtype=torch.float16), 1e-6) is None
    x32 = torch.randn(3, 8)
    assert token_ops.rms_norm(lib, x32, torch.ones(8, dtype=torch.bfloat16), 1e-6) is None  # weight in another dtype
    assert token_ops.rope(lib, torch.randn(3, 2, 8)[..., ::2], torch.ones(3, 4), torch.ones(3, 4)) is None


def _router(kind: str, arch: str, renorm: bool, dtype: torch.dtype) -> Router:
    cfg = ModelConfig(path="", architecture=arch, hf_config=None, vocab_size=8, hidden_size=64, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, attention_bias=False, qk_norm=False, max_position_embeddings=8,
                      layer_windows=(None,), eos_token_ids=frozenset(), num_experts=16, num_experts_per_tok=4,
                      norm_topk_prob=renorm, router=kind, routed_scaling_factor=2.5 if kind != "softmax" else 1.0,
                      n_group=4 if kind != "softmax" else 1, topk_group=2 if kind != "softmax" else 1)
    r = Router(cfg).to(dtype)
    r.weight.data = torch.randn(16, 64).to(dtype) / 4
    if kind == "deepseek_v3":
        r.e_score_correction_bias.data = (torch.randn(16) / 8).to(dtype)
    return r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,arch,renorm", [("softmax", "Qwen3MoeForCausalLM", True),
                                              ("softmax", "Qwen3MoeForCausalLM", False),
                                              ("softmax", "MixtralForCausalLM", True),
                                              ("deepseek_v3", "DeepseekV3ForCausalLM", True),
                                              ("deepseek_v3", "DeepseekV3ForCausalLM", False)])
@pytest.mark.parametrize("tokens", [3, 80])  # logits computed natively, or by torch's GEMM
def test_router_matches_torch(dtype: torch.dtype, kind: str, arch: str, renorm: bool, tokens: int) -> None:
    torch.manual_seed(tokens)
    r = _router(kind, arch, renorm, dtype)
    x = torch.randn(tokens, 64).to(dtype)
    with torch.no_grad():
        want_ids, want_w = r(x)
        r.token_ops = lib
        ids, w = r(x)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    order = want_ids.sort(dim=-1).indices, ids.sort(dim=-1).indices
    assert torch.equal(want_ids.gather(1, order[0]), ids.gather(1, order[1]))  # the same experts
    want_w, w = want_w.float().gather(1, order[0]), w.gather(1, order[1])
    if dtype == torch.bfloat16 and arch == "Qwen3MoeForCausalLM":
        assert torch.equal(w, w.to(torch.bfloat16).float())  # handed on as bfloat16 values
    torch.testing.assert_close(w, want_w, rtol=4 * torch.finfo(torch.float32 if kind != "softmax" else dtype).eps,
                               atol=1e-6)
