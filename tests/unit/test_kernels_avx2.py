"""The kernels' AVX2 paths (a CPU without AVX-512: the panel linears, SwiGLU, prefill and decode
attention in 8-wide vectors), built with -march=haswell and checked against torch here, so a
machine with AVX-512 still tests the code an AVX2-only machine runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import linear_panels
from engine.attention import NativeDecode, _native_decode, prefill_attention


def _avx2_cpu() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx2" in flags and "fma" in flags


@pytest.fixture(scope="module")
def lib():
    if not _avx2_cpu():
        pytest.skip("this CPU cannot run AVX2 code")
    from engine.native import library_for

    try:
        return library_for("haswell")
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no AVX2 build here: {e}")


def test_the_avx2_build_serves_float32_only(lib):
    assert linear_panels.served(lib, torch.float32) and not linear_panels.served(lib, torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 50])
@pytest.mark.parametrize("n,k", [(203, 96), (64, 600), (1000, 40)])
def test_panel_linear(lib, rows, n, k):
    g = torch.Generator().manual_seed(rows + n)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    out = linear_panels.linear(lib, x, linear_panels.pack_panels(w), b, n)
    torch.testing.assert_close(out, x @ w.t() + b, atol=1e-4, rtol=1e-5)


def test_swiglu(lib):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(192, 64, generator=g), torch.randn(9, 64, generator=g)
    out = linear_panels.linear(lib, x, linear_panels.pack_panels(linear_panels.pair_gate_up(w)), None, 192, swiglu=True)
    gate, up = (x @ w.t()).split([96, 96], dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,offset", [(5, 0), (100, 0), (40, 70)])
def test_prefill_attention(lib, n, offset):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, 8, 64, generator=g)
    k, v = torch.randn(n + offset, 2, 64, generator=g), torch.randn(n + offset, 2, 64, generator=g)
    out = prefill_attention(lib, q, k, v, offset, 0.125)
    mask = torch.ones(n, n + offset, dtype=torch.bool).tril(offset)
    ref = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                         scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_decode_attention(lib):
    g = torch.Generator().manual_seed(3)
    b, bs, kvh, hd, heads, ctx = 3, 16, 2, 64, 8, 40
    cache = torch.randn(2, 12, bs, kvh, hd, generator=g)
    tables = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    q = torch.randn(b, heads, hd, generator=g)
    out = _native_decode(q, cache, NativeDecode(lib, tables, torch.full((b,), ctx, dtype=torch.long), 2), 0.125)
    for i in range(b):
        keys = cache[0][tables[i]].reshape(-1, kvh, hd)[:ctx]
        vals = cache[1][tables[i]].reshape(-1, kvh, hd)[:ctx]
        ref = F.scaled_dot_product_attention(q[i][None, :, None], keys.transpose(0, 1)[None],
                                             vals.transpose(0, 1)[None], scale=0.125, enable_gqa=True)
        torch.testing.assert_close(out[i], ref[0, :, 0], atol=2e-6, rtol=1e-5)
