"""The native prefill attention kernel (engine/csrc/prefill_attention.c) against torch's
scaled_dot_product_attention: causal from 0 and after cached keys, grouped heads, strided inputs,
a value width other than the keys', partial blocks; and the engine's prefill through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import linear_panels
from engine.attention import prefill_attention
from engine.native import native_lib

LIB = native_lib()
DTYPES = [d for d in (torch.float32, torch.bfloat16) if linear_panels.served(LIB, d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="the kernel needs the native kernels with AVX2 or AVX-512")


def reference(q, k, v, offset, scale):
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(offset)
    o = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("n,offset,heads,kv_heads,hd,vd", [
    (1, 0, 4, 2, 64, 64), (5, 0, 4, 2, 64, 64), (271, 0, 16, 8, 64, 64), (100, 37, 4, 4, 32, 32),
    (70, 200, 16, 1, 96, 80), (64, 64, 2, 2, 128, 128), (33, 0, 6, 3, 16, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_sdpa(n, offset, heads, kv_heads, hd, vd, dtype):
    g = torch.Generator().manual_seed(n + offset)
    # q, k and v as slices of one projection's output, as the model hands them over
    width = heads * hd + kv_heads * hd + kv_heads * vd
    qkv = torch.randn(n + offset, width, generator=g).to(dtype)
    q = qkv[offset:, : heads * hd].view(n, heads, hd)
    k = qkv[:, heads * hd : heads * hd + kv_heads * hd].view(n + offset, kv_heads, hd)
    v = qkv[:, heads * hd + kv_heads * hd :].view(n + offset, kv_heads, vd)
    out = prefill_attention(LIB, q, k, v, offset, hd ** -0.5)
    assert out is not None and out.dtype == dtype and out.shape == (n, heads, vd)
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), reference(q, k, v, offset, hd ** -0.5), **tol)


def test_unserved_shapes_answer_none():
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    assert prefill_attention(LIB, q, k, torch.randn(4, 2, 12), 0, 0.25) is None  # vd not a vector multiple
    assert prefill_attention(LIB, q.double(), k.double(), k.double(), 0, 0.25) is None
    assert prefill_attention(LIB, torch.randn(4, 3, 16), k, k, 0, 0.25) is None  # heads not a multiple


def test_engine_prefill_through_the_kernel_equals_torch(checkpoint, monkeypatch):
    from engine import attention
    from pdcluster import LLM, SamplingParams

    served: list[int] = []  # the causal offset of each span the kernel answered
    kernel = attention.prefill_attention

    def counted(lib, q, k, v, offset, scale):
        out = kernel(lib, q, k, v, offset, scale)
        if out is not None:
            served.append(offset)
        return out

    monkeypatch.setattr(attention, "prefill_attention", counted)
    path = str(checkpoint("llama-gqa"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 70, 130)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    fast_llm = LLM(path, num_blocks=64, max_model_len=256)
    eager_llm = LLM(path, num_blocks=64, max_model_len=256, enforce_eager=True)
    for batch in (prompts, [p + [7] * 40 for p in prompts]):  # again after cached prefixes: keys offset
        served.clear()
        fast, eager = fast_llm.generate(batch, sp), eager_llm.generate(batch, sp)
        assert [o.token_ids for o in fast] == [o.token_ids for o in eager]
        assert served  # the kernel took the prompts (the eager engine never calls it)
        assert any(o > 0 for o in served) == (batch is not prompts)  # the second time after cached keys
