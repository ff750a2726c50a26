"""The native panel kernel (engine/csrc/linear_panels.c) against torch's float32 matmul, at every
batch size the engine runs and shapes that leave partial panels, and PackedLinear on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import linear_panels
from engine.native import native_lib
from engine.packed_linear import PackedLinear, mlp_on_panels

LIB = native_lib()
DTYPES = [d for d in (torch.float32, torch.bfloat16) if linear_panels.served(LIB, d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="the panel kernel needs the native kernels with AVX2 or AVX-512")


@pytest.mark.parametrize("n,k", [(203, 96), (64, 64), (16, 2), (1000, 384), (130, 514)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_panels_round_trip(n, k, dtype):
    w = torch.randn(n, k).to(dtype)
    packed = linear_panels.pack_panels(w)
    assert packed.numel() == -(-n // 16) * 16 * k  # pad columns to 16 only
    assert torch.equal(linear_panels.unpack_panels(packed, n, k), w)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 16, 17, 64, 300])
@pytest.mark.parametrize("n,k", [(203, 96), (1000, 384), (48, 600)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_equals_float32_matmul(rows, n, k, dtype):
    g = torch.Generator().manual_seed(rows * 7 + n)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, 2 * k, generator=g).to(dtype)[:, :k]  # rows 2k apart
    out = linear_panels.linear(LIB, x, linear_panels.pack_panels(w), b, n)
    ref = x.float() @ w.float().t() + b.float()
    assert out is not None and out.dtype == dtype and out.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    else:  # float32 sums rounded once to bfloat16: within half a bfloat16 ulp of the exact sum, and a bit
        torch.testing.assert_close(out.float(), ref.to(dtype).float(), atol=1e-2, rtol=2 ** -7)


def test_odd_bfloat16_depth_is_refused():
    with pytest.raises(ValueError, match="even in_features"):
        linear_panels.pack_panels(torch.zeros(16, 3, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_runs_on_panels_only(dtype):
    torch.manual_seed(0)
    ref = nn.Linear(96, 203, bias=True).to(dtype)
    packed = PackedLinear(ref, panels=LIB)
    assert packed.panels is not None and not hasattr(packed, "packed_weight")  # one copy of the weight
    assert "native panels" in repr(packed)
    x = torch.randn(2, 5, 96).to(dtype)  # any leading shape
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(packed(x), ref(x), **tol)
    wide = torch.randn(7, 192).to(dtype)[:, ::2]  # a strided input
    torch.testing.assert_close(packed(wide), ref(wide), **tol)
    other = torch.float64
    torch.testing.assert_close(packed(x.to(other)).to(dtype), ref(x), **tol)  # another dtype still answers


@pytest.mark.parametrize("rows", [1, 7, 16, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_pass_equals_silu_times_up(rows, dtype):
    torch.manual_seed(rows)
    inter, hidden = 96, 64
    ref = nn.Linear(hidden, 2 * inter, bias=False).to(dtype)
    packed = PackedLinear(ref, panels=LIB, gate_up=True)
    assert packed.paired
    x = torch.randn(rows, hidden).to(dtype)
    gate, up = ref(x).split([inter, inter], dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = linear_panels.linear(LIB, x, packed.panels, None, 2 * inter, swiglu=True)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x), ref(x), atol=1e-5, rtol=1e-5)  # the plain output, unpaired
    else:  # each of torch's three roundings made in the same places: a bfloat16 ulp at most
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
        torch.testing.assert_close(packed(x).float(), ref(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_on_panels_is_down_of_silu_times_up(dtype):
    torch.manual_seed(0)
    inter, hidden = 96, 64
    gate_up, down = nn.Linear(hidden, 2 * inter, bias=False).to(dtype), nn.Linear(inter, hidden, bias=False).to(dtype)
    fused_gate_up, fused_down = PackedLinear(gate_up, panels=LIB, gate_up=True), PackedLinear(down, panels=LIB)
    x = torch.randn(2, 9, 2 * hidden).to(dtype)[..., ::2]  # any leading shape, strided
    gate, up = gate_up(x).split([inter, inter], dim=-1)
    want = down(torch.nn.functional.silu(gate) * up)
    got = mlp_on_panels(fused_gate_up, fused_down, x)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(got, want, **tol)
    odd = PackedLinear(nn.Linear(hidden, 2 * 40, bias=False).to(dtype), panels=LIB, gate_up=True)
    assert not odd.paired and mlp_on_panels(odd, fused_down, x) is None  # 40 wide: not paired by 32
    assert mlp_on_panels(fused_gate_up, down, x) is None  # down not on panels: the module path


def test_mlp_runs_its_gate_up_fused_after_packing(checkpoint):
    from engine.config import ModelConfig
    from engine.loader import load_model

    cfg = ModelConfig.from_pretrained(checkpoint("llama-gqa"))
    model = load_model(cfg, torch.float32, torch.device("cpu"), 64)
    plain = load_model(cfg, torch.float32, torch.device("cpu"), 64, pack=False)
    mlp, ref = model.layers[0].mlp, plain.layers[0].mlp
    if mlp.inter % 32:
        pytest.skip("this checkpoint's MLP is not a multiple of 32 wide")
    assert mlp.gate_up_proj.paired
    x = torch.randn(9, cfg.hidden_size)
    assert mlp_on_panels(mlp.gate_up_proj, mlp.down_proj, x) is not None  # the fused call serves this MLP
    torch.testing.assert_close(mlp(x), ref(x), atol=1e-5, rtol=1e-5)
