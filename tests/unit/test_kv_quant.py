"""Quantized KV pages (engine/kv_quant.py): the row format against its reference formulas,
attention on quantized pages against attention on the dequantized tensors (torch path and the
native kernel), what a page costs, and the settings that name it."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, DecodeGroup, NativeDecode, _native_decode, paged_attention, write_kv
from engine.config import EngineConfig
from engine.kv_quant import KVQuant, parse_kv_cache_dtype
from engine.kv_spec import KVSpec, mismatch
from engine.native import native_lib

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
lib = native_lib()


@pytest.mark.parametrize("name", FORMATS)
def test_a_row_is_its_values_then_its_scale(name: str) -> None:
    q = KVQuant(name)
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]  # scales far apart
    x[0, 0] = 0.0  # an all-zero row
    rows = q.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)[..., 0]
    amax = x.abs().amax(-1)
    want = torch.where(amax > 0, amax / q.qmax, torch.ones_like(amax))
    assert torch.equal(scale, want)
    values = rows[..., :64].contiguous().view(q.value_dtype)
    if name == "int8":  # round(x / s), within [-127, 127]
        assert torch.equal(values.float(), (x / want[..., None]).round().clamp(-127, 127))
    else:  # the format's own rounding of x / s
        assert torch.equal(values.float(), (x / want[..., None]).to(q.value_dtype).float())
    back = q.dequantize(rows, torch.float32)
    assert torch.equal(back, values.float() * want[..., None])
    assert torch.equal(back[0, 0], torch.zeros(64))
    # the error is a fraction of each row's own largest magnitude, whatever its scale
    rel = ((back - x).abs().amax(-1) / amax.clamp_min(1e-30))[amax > 0]
    assert rel.max() <= {"int8": 0.5 / 127 + 1e-6, "fp8_e4m3": 0.07, "fp8_e5m2": 0.13}[name]


def test_rows_of_an_odd_width_are_refused_and_unknown_names_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        KVQuant("int8").quantize(torch.randn(2, 6))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, fp8_e5m2, got 'int4'"):
        parse_kv_cache_dtype("int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp16")
    assert parse_kv_cache_dtype("auto") is None


def test_a_page_costs_one_byte_a_value_and_a_scale_a_row() -> None:
    plain, q = KVSpec(6, 4, 48), KVSpec(6, 4, 48, cache_dtype="int8")
    assert q.layer_shape(10, 16) == (2, 10, 16, 4, 52) and q.storage_dtype(torch.float32) == torch.uint8
    assert q.bytes_per_token(torch.float32) == 2 * 6 * 4 * 52
    assert plain.bytes_per_token(torch.float32) / q.bytes_per_token(torch.float32) == pytest.approx(4 * 48 / 52)
    latent = KVSpec(61, 1, 576, 512, cache_dtype="fp8_e4m3")  # DeepSeek-V3: 580 bytes a token and layer
    assert latent.bytes_per_token(torch.bfloat16) == 580 * 61
    # a pair whose pages differ is refused naming it
    a = q.compat_key(torch.float32, 16, ["m"])
    assert mismatch(a, plain.compat_key(torch.float32, 16, ["m"])) == "kv heads:4x48x6,int8 vs heads:4x48x6"


def _cache_and_meta(name: str | None, kvh: int = 2, hd: int = 64, blocks: int = 6, bs: int = 8):
    """A layer's cache with 3 sequences written through write_kv, and the values written."""
    quant = None if name is None else KVQuant(name)
    width = hd + (4 if quant else 0)
    cache = torch.zeros(2, blocks, bs, kvh, width, dtype=torch.uint8 if quant else torch.float32)
    torch.manual_seed(0)
    k, v = torch.randn(40, kvh, hd) * 2, torch.randn(40, kvh, hd)
    slots = torch.randperm(blocks * bs)[:40]
    write_kv(cache, k, v, AttentionMetadata(slot_mapping=slots, kv_quant=quant))
    return cache, quant, slots


def _plain_copy(cache: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """The dequantized tensors of a quantized cache, as a float32 cache."""
    return quant.dequantize(cache, torch.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_attention_on_quantized_pages_equals_attention_on_their_values(name: str) -> None:
    cache, quant, slots = _cache_and_meta(name)
    plain = _plain_copy(cache, quant)
    kvh, hd, bs = 2, 64, 8
    q = torch.randn(3, 4, hd)
    tables = slots.view(-1)[:15].div(bs, rounding_mode="floor").unique()[:4].repeat(3, 1)
    lens = torch.tensor([10, 25, 32])
    mask = (torch.arange(tables.shape[1] * bs)[None, :] < lens[:, None])[:, None, None, :]
    group = DecodeGroup(torch.arange(3), tables, mask)
    new = torch.zeros(3, kvh, hd)
    got = paged_attention(q, new, new, cache, AttentionMetadata(slot_mapping=slots, decode_groups=[group],
                                                                kv_quant=quant), 0.125)
    want = paged_attention(q, new, new, plain, AttentionMetadata(slot_mapping=slots, decode_groups=[group]), 0.125)
    assert torch.equal(got, want)
    if lib is None:
        return
    nd = NativeDecode(lib, tables, lens, threads=2)
    native = _native_decode(q, cache, nd, 0.125, quant)  # the kernel dequantizes as it reads the bytes
    native_plain = _native_decode(q, plain, nd, 0.125)
    assert torch.allclose(native, native_plain, atol=1e-6, rtol=1e-5)
    assert torch.allclose(native, want, atol=1e-5, rtol=1e-4)


def test_every_read_of_a_key_sees_the_same_quantized_row() -> None:
    """A prompt prefilled whole, in chunks of 16 (later chunks read the earlier ones from the pages),
    and generated from: the same logprobs wherever its keys were read from."""
    from pdcluster import LLM, SamplingParams

    prompt = [1] + [(31 * j) % 8000 + 4 for j in range(70)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = [LLM("builtin:tiny-llama", dtype="float32", kv_cache_dtype="int8", num_blocks=32, max_model_len=128,
                max_num_batched_tokens=tokens, max_num_seqs=8).generate([prompt], params)[0]
            for tokens in (2048, 16)]
    whole, chunked = ([lp.logprob for lp in o.prompt_logprobs if lp is not None] for o in outs)
    assert len(whole) == len(prompt) - 1
    assert outs[0].token_ids == outs[1].token_ids
    assert max(abs(a - b) for a, b in zip(whole, chunked)) < 1e-4
