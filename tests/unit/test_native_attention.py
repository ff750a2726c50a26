"""The native paged decode attention (engine/csrc) equals the torch path on the same cache."""

from __future__ import annotations

import pytest
import torch

from engine import native
from engine.attention import AttentionMetadata, DecodeGroup, NativeDecode, paged_attention

LIB = native.native_lib()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here: the engine uses the torch path")


def _case(b: int, heads: int, kv_heads: int, hd: int, bs: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    cache = torch.randn(2, num_blocks, bs, kv_heads, hd, generator=g).to(dtype)
    lens = torch.randint(1, 6 * bs, (b,), generator=g)
    width = int((lens.max() + bs - 1) // bs)
    tables = [torch.randperm(num_blocks, generator=g)[: -(-int(n) // bs)].tolist() for n in lens]
    q = torch.randn(b, heads, hd, generator=g).to(dtype)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    return cache, q, lens, padded


def _torch_path(q, cache, lens, padded, scale, starts=None):
    """cache: [2, blocks, bs, kvh, hd], or (keys, values) views of a latent cache."""
    bs = cache[0].shape[1]
    slot = torch.arange(padded.shape[1] * bs)[None, :]
    mask = (slot < lens[:, None]) & (slot >= (starts if starts is not None else torch.zeros_like(lens))[:, None])
    mask = mask[:, None, None, :]
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             decode_groups=[DecodeGroup(torch.arange(q.shape[0]), padded, mask)])
    kvh = cache[0].shape[2]
    return paged_attention(q, q[:, :kvh], q[:, :kvh, : cache[1].shape[-1]], cache, meta, scale)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("b", "heads", "kv_heads", "hd", "bs"), [
    (1, 4, 4, 64, 16),    # MHA, one sequence
    (5, 8, 2, 48, 16),    # GQA 4:1, head_dim 48
    (16, 16, 8, 64, 16),  # the llama-200m shape
    (3, 6, 1, 128, 32),   # MQA, larger blocks
    (2, 4, 2, 36, 8),     # head_dim not a multiple of 8
])
def test_native_matches_torch(b, heads, kv_heads, hd, bs, threads):
    cache, q, lens, padded = _case(b, heads, kv_heads, hd, bs, torch.float32, seed=b * hd + bs)
    scale = hd ** -0.5
    ref = _torch_path(q, cache, lens, padded, scale)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             native_decode=NativeDecode(LIB, padded, lens, threads))
    out = paged_attention(q, q, q, cache, meta, scale)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 23])
def test_native_window_starts_match_torch(window):
    """A sliding window: each row's keys begin at its `starts` entry (mid-block or on a boundary)."""
    cache, q, lens, padded = _case(6, 8, 2, 48, 16, torch.float32, seed=window)
    starts = (lens - window).clamp(min=0)
    scale = 48 ** -0.5
    ref = _torch_path(q, cache, lens, padded, scale, starts)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             native_decode=NativeDecode(LIB, padded, lens, 2, starts))
    torch.testing.assert_close(paged_attention(q, q, q, cache, meta, scale), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("b", "heads", "latent", "rope", "dtype"), [
    (3, 4, 32, 8, torch.float32),      # the test checkpoints' scale
    (1, 40, 64, 16, torch.float32),    # more query rows than a unit holds: each sequence's rows split
    (4, 16, 512, 64, torch.bfloat16),  # DeepSeek's latent (mla-400m)
])
def test_native_latent_cache_matches_torch(b, heads, latent, rope, dtype, threads):
    """Latent attention (engine/models/mla.py): one cached row [latent, rope] per token is the key,
    and its first `latent` values are the value, both read in place from the one cache."""
    cache, q, lens, padded = _case(b, heads, 1, latent + rope, 16, dtype, seed=heads + latent)
    rows = cache[:1]  # (1, blocks, bs, 1, latent + rope): a latent layer's cache
    views = (rows[0], rows[0][..., :latent])
    scale = (latent + rope) ** -0.5
    ref = _torch_path(q.float(), (views[0].float(), views[1].float()), lens, padded, scale)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             native_decode=NativeDecode(_TilesOnly(LIB) if dtype == torch.bfloat16 and
                                                        LIB.pd_amx_ready() else LIB, padded, lens, threads))
    out = paged_attention(q, q, q[..., :latent], views, meta, scale)
    assert out.shape == (b, heads, latent) and out.dtype == dtype
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize(("b", "heads", "kv_heads", "hd", "bs", "window"), [
    (3, 8, 2, 64, 16, None),   # GQA: 4 query rows of a tile's 16 per KV head
    (2, 40, 1, 96, 8, None),   # three 16-row groups, blocks of 8 (tiles gather tokens across blocks)
    (5, 8, 4, 128, 32, 21),    # a sliding window, larger blocks
    (1, 16, 1, 64, 16, None),  # one sequence, one KV head: its 16 rows split over the threads
])
def test_bfloat16_decode_on_tiles_matches_float_math(b, heads, kv_heads, hd, bs, window):
    """Where the CPU has AMX, bfloat16 decode runs on tiles (engine/csrc/decode_attention_amx.c);
    elsewhere the vector kernel: either way the float math on the same bf16 values, to bf16's
    precision (probabilities are rounded to bf16 for the value product on tiles)."""
    cache, q, lens, padded = _case(b, heads, kv_heads, hd, bs, torch.bfloat16, seed=hd + bs)
    starts = (lens - window).clamp(min=0) if window else None
    scale = hd ** -0.5
    ref = _torch_path(q.float(), cache.float(), lens, padded, scale, starts)
    # on AMX the tiles must serve: the vector kernel is taken away
    lib = _TilesOnly(LIB) if LIB.pd_amx_ready() else LIB
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             native_decode=NativeDecode(lib, padded, lens, 2, starts))
    out = paged_attention(q, q, q, cache, meta, scale)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


class _TilesOnly:
    """The native library without its vector decode kernel."""

    def __init__(self, lib) -> None:
        self.decode_attention_amx = lib.decode_attention_amx

    def paged_decode_attention(self, *args):
        raise AssertionError("the tile kernel refused a shape it serves")


def test_native_bfloat16_cache():
    cache, q, lens, padded = _case(4, 8, 4, 64, 16, torch.bfloat16, seed=7)
    scale = 64 ** -0.5
    ref = _torch_path(q.float(), cache.float(), lens, padded, scale)  # same bf16 values, float math
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             native_decode=NativeDecode(LIB, padded, lens, 2))
    out = paged_attention(q, q, q, cache, meta, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)  # only the final bf16 rounding differs


def test_build_is_cached_and_named_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    cc = native._compiler()
    first = native._build(cc)
    assert first.is_file() and first.parent == tmp_path / "native"
    mtime = first.stat().st_mtime_ns
    assert native._build(cc) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert native._load(first).paged_decode_attention is not None


def test_a_failed_build_names_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-fno-such-flag"])
    with pytest.raises(RuntimeError, match="exited with"):
        native._build(native._compiler())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_read_in_place_from_a_wider_tensor(dtype):
    """The query heads as Attention hands them over: the first heads of each token's q/k rows
    (a strided view), read in place, give what their contiguous copy gives."""
    cache, q, lens, padded = _case(3, 8, 2, 64, 16, dtype, seed=11)
    wide = torch.cat([q, torch.randn(3, 2, 64).to(dtype)], dim=1)  # (b, heads + kv heads, hd)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             native_decode=NativeDecode(LIB, padded, lens, 2))
    strided = wide[:, :8]
    assert not strided.is_contiguous()
    assert torch.equal(paged_attention(strided, q, q, cache, meta, 0.125), paged_attention(q, q, q, cache, meta, 0.125))
