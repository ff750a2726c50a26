"""Attention over the paged KV cache (torch on any device; a native decode kernel on CPU).

Per layer the cache is one tensor `kv[2, num_blocks, block_size, num_kv_heads, head_dim]`; viewed
flat, token slot `s = block_id * block_size + offset` is row `s` of `kv[0].view(-1, kvh, hd)`.
The model runner turns block tables into the indices below once per step, one set per distinct
sliding window of the model's layers (engine/config.py `layer_windows`); the layers sharing a window
reuse it. A windowed set names only the blocks inside the window, so blocks the block manager has
taken back (engine/block_manager.py `release_outside_window`) are never read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_quant import KVQuant


# bfloat16 decode attention on AMX tiles (engine/csrc/decode_attention_amx.c) where the CPU has them;
# PDCLUSTER_AMX_ATTENTION=0 keeps the vector kernel
AMX_ATTENTION = os.environ.get("PDCLUSTER_AMX_ATTENTION", "1") != "0"


@dataclass
class SeqSpan:
    """One sequence's slice of a packed batch: queries `[q_start, q_end)` see `ctx_len` keys (the
    sequence's last `ctx_len` positions: all of them, or those inside the earliest query's window)."""

    q_start: int
    q_end: int
    ctx_len: int
    kv_index: torch.Tensor | None  # (ctx_len,) slots of the keys; None when they are exactly the new tokens
    mask: torch.Tensor | None  # (q_len, ctx_len) bool, True = may attend; None when causal from 0
    # query i sees keys j <= i + causal_offset, no other limit (the native prefill kernel serves it);
    # None where a window or a bound also masks
    causal_offset: int | None = None


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended to in one padded batch."""

    rows: torch.Tensor  # (b,) positions of these sequences in the packed batch
    block_tables: torch.Tensor  # (b, max_blocks) block ids, padded with block 0
    # (b, 1, 1, max_blocks * block_size) bool, False past each sequence's end and, with a window,
    # before its start
    mask: torch.Tensor


@dataclass
class NativeDecode:
    """Decode rows for the native kernel (engine/native.py), which reads the cache in place."""

    lib: object  # the loaded ctypes library
    block_tables: torch.Tensor  # (T, max_blocks) int64, row i = packed-batch row i, padded with 0
    context_lens: torch.Tensor  # (T,) int64, the end of each row's keys in its table (its new one included)
    threads: int
    starts: torch.Tensor | None = None  # (T,) int64, where each row's keys begin in its table (a window)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    # decode (every sequence has one new token): sequences of similar length batched together
    decode_groups: list[DecodeGroup] | None = None
    # decode rows through the native kernel (CPU, float32 / bfloat16 cache): the batch's first
    # `len(context_lens)` rows, alone or ahead of `spans` in a mixed step
    native_decode: NativeDecode | None = None
    # prefill / mixed: one span per sequence (the rows after the native decode rows, if any)
    spans: list[SeqSpan] | None = None
    # quantized pages (engine/kv_quant.py): rows are written quantized and dequantized as gathered
    kv_quant: KVQuant | None = None
    # the native kernels, for spans with a plain causal mask (engine/csrc/prefill_attention.c)
    native_prefill: object | None = None

    def stored(self, rows: torch.Tensor) -> torch.Tensor:
        """New rows (T, heads, d) as the cache keeps them."""
        return rows if self.kv_quant is None else self.kv_quant.quantize(rows)

    def values(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered cache rows as values in `dtype` (the same rows when the cache is not quantized)."""
        return rows if self.kv_quant is None else self.kv_quant.dequantize(rows, dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the new tokens' K/V (T, kvh, hd) at their slots; returns them as the cache holds them:
    k and v, or for quantized pages with prefill spans their dequantized rows, so that a prefill's
    queries attend to the keys every later read sees (decode steps, later chunks, prefix-cache
    hits, a decode worker). Decode rows read the cache itself: nothing to dequantize for them."""
    kvh, width = kv_cache.shape[-2:]
    rows = meta.stored(k), meta.stored(v)
    kv_cache[0].view(-1, kvh, width).index_copy_(0, meta.slot_mapping, rows[0])
    kv_cache[1].view(-1, kvh, width).index_copy_(0, meta.slot_mapping, rows[1])
    if meta.spans is None:
        return k, v
    return meta.values(rows[0], k.dtype), meta.values(rows[1], v.dtype)


def paged_attention(
    q: torch.Tensor,  # (T, H, hd)
    k: torch.Tensor,  # (T, kvh, hd) new keys (already written to the cache)
    v: torch.Tensor,  # (T, kvh, vd) new values
    kv_cache: torch.Tensor,  # or (keys, values) as views of one latent cache (engine/models/mla.py)
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,  # (H,) a learned logit per head joining each softmax (gpt-oss)
) -> torch.Tensor:  # (T, H, vd)
    """Each query's attention over its keys in the cache; with `sinks`, through `_sink_attention`
    (the native kernel never serves those: engine/model_runner.py)."""
    kvh, hd = k.shape[-2:]
    sdpa = F.scaled_dot_product_attention if sinks is None else _sink_attention(sinks)
    vd = v.shape[-1]  # the values' width (a latent cache's is narrower than its keys')
    outs = []
    if meta.native_decode is not None:
        outs.append(_native_decode(q[: len(meta.native_decode.context_lens)], kv_cache, meta.native_decode, scale,
                                   meta.kv_quant))
        if meta.spans is None:
            return outs[0]
    if meta.decode_groups is not None:
        out = q.new_empty((*q.shape[:2], vd))
        for group in meta.decode_groups:
            # Whole blocks are gathered (contiguous block_size*kvh*hd runs, much faster than token
            # rows); positions past each sequence's end are masked.
            b, L = group.block_tables.shape[0], group.mask.shape[-1]
            width = kv_cache[0].shape[-1]
            kb = meta.values(kv_cache[0][group.block_tables].view(b, L, kvh, width), q.dtype).transpose(1, 2)
            if kv_cache[1].data_ptr() == kv_cache[0].data_ptr() and kv_cache[1].stride() == kv_cache[0].stride():
                vb = kb[..., :vd]  # the values are the keys' first vd (a latent cache): gathered once
            else:
                v_width = kv_cache[1].shape[-1]
                vb = meta.values(kv_cache[1][group.block_tables].view(b, L, kvh, v_width), q.dtype).transpose(1, 2)
            if sinks is None:
                # each KV head's query heads as the query rows of one head: (b, kvh, H/kvh, hd); no
                # copy of a key per query head (what enable_gqa costs; 16x for MLA's one latent)
                qb = q[group.rows].view(b, kvh, -1, hd)
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=group.mask, scale=scale)
                out[group.rows] = o.reshape(b, -1, vd)
                continue
            qb = q[group.rows].unsqueeze(2)  # (b, H, 1, hd)
            o = sdpa(qb, kb, vb, attn_mask=group.mask, scale=scale, enable_gqa=True)
            out[group.rows] = o.squeeze(2)
        return out
    assert meta.spans is not None
    k_flat = kv_cache[0].view(-1, kvh, kv_cache[0].shape[-1])
    v_flat = kv_cache[1].view(-1, kvh, kv_cache[1].shape[-1])
    for span in meta.spans:
        if meta.native_prefill is not None and sinks is None and span.causal_offset is not None:
            if span.kv_index is None:
                ks, vs = k[span.q_start : span.q_end], v[span.q_start : span.q_end]
            else:
                ks, vs = meta.values(k_flat[span.kv_index], q.dtype), meta.values(v_flat[span.kv_index], q.dtype)
            o = prefill_attention(meta.native_prefill, q[span.q_start : span.q_end], ks, vs[..., :vd],
                                  span.causal_offset, scale)
            if o is not None:
                outs.append(o)
                continue
        qs = q[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # (1, H, n, hd)
        if span.kv_index is None:  # whole sequence is new: keys are exactly this slice
            ks = k[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
            vs = v[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
            # causal, or masked where a window cuts into the prompt
            o = sdpa(qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None and qs.shape[2] > 1,
                     scale=scale, enable_gqa=True)
        else:
            ks = meta.values(k_flat[span.kv_index], q.dtype).transpose(0, 1).unsqueeze(0)  # (1, kvh, ctx, hd)
            vs = meta.values(v_flat[span.kv_index], q.dtype)[..., :vd].transpose(0, 1).unsqueeze(0)
            o = sdpa(qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=True)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def prefill_attention(lib, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                      scale: float) -> torch.Tensor | None:
    """Causal attention of q (n, H, hd) over k (nk, kvh, hd), v (nk, kvh, vd), query i seeing keys
    j <= i + offset, on the native kernel; None where it does not serve these tensors."""
    if q.dtype not in (torch.float32, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype) \
            or q.device.type != "cpu" or any(t.stride(-1) != 1 for t in (q, k, v)):
        return None
    n, heads, hd = q.shape
    nk, kvh, vd = v.shape
    out = torch.empty(n, heads, vd, dtype=q.dtype)
    rc = lib.pd_prefill_attention(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                                  v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), heads * vd, vd, n, nk,
                                  heads, kvh, hd, vd, offset, scale, int(q.dtype == torch.bfloat16),
                                  torch.get_num_threads())
    return out if rc == 0 else None


def _sink_attention(sinks: torch.Tensor):
    """SDPA's signature, with each head's sink logit joining the softmax and taking probability
    mass but adding no value; computed as transformers' eager gpt-oss attention does (explicit
    matmul, mask, max subtracted, softmax, the sink's column dropped) so float results agree."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False, scale: float = 1.0, enable_gqa: bool = True) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # (b, H, n, L)
        n, L = logits.shape[-2:]
        if is_causal:
            attn_mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
        if attn_mask is not None:
            bias = torch.zeros(attn_mask.shape, dtype=logits.dtype, device=q.device)
            logits = logits + bias.masked_fill(~attn_mask, torch.finfo(logits.dtype).min)
        sink = sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(logits.shape[0], -1, n, 1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v)

    return attend


# engine/csrc/paged_decode_attention.c's cache formats: the queries' dtype, or quantized pages
KV_FORMATS = {None: 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}


def native_decode_supported(kv_cache: torch.Tensor) -> bool:
    """float32 / bfloat16 caches, and quantized pages (bytes), on the CPU, contiguous."""
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in (torch.float32, torch.bfloat16, torch.uint8)
            and kv_cache.is_contiguous())


def _native_decode(q: torch.Tensor, kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], nd: NativeDecode,
                   scale: float, quant: KVQuant | None = None) -> torch.Tensor:
    """kv_cache: a layer's [2, blocks, bs, kvh, hd], or (keys, values) as views of one latent cache
    whose values are each key row's first vd (the kernel reads both in place); `quant`: the rows
    are quantized pages (hd bytes and a scale), dequantized by the kernel as it reads them."""
    T, H, hd = q.shape
    keys, values = kv_cache[0], kv_cache[1]
    _, bs, kvh, _ = keys.shape
    vd = min(values.shape[-1], hd)  # a quantized row's scale bytes are not values
    if values.stride() != keys.stride():
        raise RuntimeError("native decode attention needs keys and values laid out alike")
    if q.stride(2) != 1 or q.stride(1) != hd:  # the kernels read each sequence's heads as one run
        q = q.contiguous()
    out = torch.empty((T, H, vd), dtype=torch.float32)
    if q.dtype == torch.bfloat16 and keys.dtype == torch.bfloat16 and AMX_ATTENTION and quant is None:
        rc = nd.lib.decode_attention_amx(  # where the CPU has AMX tiles and the widths fit them
            q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), nd.block_tables.data_ptr(),
            nd.context_lens.data_ptr(),
            nd.starts.data_ptr() if nd.starts is not None else None, out.data_ptr(),
            T, kvh, H // kvh, hd, vd, bs, nd.block_tables.shape[1], scale, nd.threads)
        if rc == -2:
            raise MemoryError("native decode attention could not allocate its buffers")
        if rc == 0:
            return out.to(q.dtype)
    rc = nd.lib.paged_decode_attention(
        q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), nd.block_tables.data_ptr(),
        nd.context_lens.data_ptr(), nd.starts.data_ptr() if nd.starts is not None else None, out.data_ptr(),
        T, kvh, H // kvh, hd, vd, bs, nd.block_tables.shape[1],
        scale, int(q.dtype == torch.bfloat16), KV_FORMATS[None if quant is None else quant.name], nd.threads,
    )
    if rc != 0:
        raise RuntimeError(f"native decode attention refused the shape (head_dim {hd}, group {H // kvh}, block {bs})")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
