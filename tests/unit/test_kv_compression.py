"""int8 KV compression: bounded error per block, exact zeros, 4x fewer bytes than float32."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.compression import dequantize_int8, quantize_int8, roundtrip


def test_int8_roundtrip_error_is_within_half_a_step_per_block():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 5, 16, 4, 48, generator=g) * torch.tensor([0.01, 1, 10, 100, 0.5])[None, :, None, None, None]
    q, scales = quantize_int8(kv)
    assert q.dtype == torch.int8 and scales.shape == (2, 5)
    back = dequantize_int8(q, scales, kv.dtype)
    err = (back - kv).abs().amax(dim=(2, 3, 4))
    assert torch.all(err <= scales / 2 + 1e-6)  # per-block scales: small blocks keep their precision
    assert q.numel() * q.element_size() * 4 == kv.numel() * kv.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip_keeps_dtype_and_zero_blocks(dtype):
    kv = torch.zeros(2, 3, 16, 2, 8, dtype=dtype)
    kv[:, 1] = 0.5
    out = roundtrip(kv, "int8")
    assert out.dtype == dtype and torch.equal(out[:, 0], kv[:, 0])
    assert torch.allclose(out.float(), kv.float(), atol=0.01)


def test_unknown_compression_is_refused():
    with pytest.raises(ValueError, match="allowed: none, int8"):
        roundtrip(torch.zeros(2, 1, 1, 1, 1), "zstd")
