"""Owns the model weights and the paged KV tensors; turns scheduled sequences into one forward pass.

This is the only place where block tables become tensors (slot mappings, gather indices, masks).
With tensor parallelism (`tp`, engine/tp_steps.py) it is one rank: rank 0's `run` first sends the
step to the other ranks, whose `forward` runs the same batch on their shards and caches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention import AttentionMetadata, DecodeGroup, NativeDecode, SeqSpan, native_decode_supported
from engine.block_runs import block_runs, copy_runs
from engine.config import EngineConfig, ModelConfig
from engine.kv_quant import parse_kv_cache_dtype
from engine.kv_spec import SCALE_BYTES
from engine.loader import load_model
from engine.models.llama import LlamaModel
from engine.native import native_lib
from engine.request_checks import resolve_max_model_len
from engine.sequence import Sequence, TokenLogprobs
from engine.tp_group import TPError, bytes_tensor
from engine.tp_steps import RankSend, TPContext, encode_copy, encode_step, settle_parts, step_hook

CPU_DEFAULT_KV_BYTES = 512 * 2**20
DECODE_PAD_SLACK = 1.3  # padded/real KV blocks allowed within one decode attention group
NATIVE_MAX_HEAD_DIM, NATIVE_MAX_BLOCK = 576, 64  # engine/csrc limits (MAX_HD, MAX_BS)


@dataclass
class ScheduledSeq:
    """`num_tokens` new tokens of `seq`, starting at `seq.num_computed_tokens`."""

    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq.token_ids)


@dataclass
class LayerSend:
    """What a step hands on after each layer (a prefill worker's KV sender): `send(layer, kv)` with
    the K/V of `blocks`, (2, len(blocks), block_size, every KV head of the model, head_dim), a copy
    (with tensor parallelism: gathered on rank 0, the fallback path); and `parts`, the direct path:
    every rank sends its own heads (engine/tp_steps.py `RankSend`), then commits them."""

    blocks: list[int]
    send: Callable[[int, torch.Tensor], None]
    parts: RankSend | None = None


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, model: LlamaModel | None = None,
                 tp: TPContext | None = None, kv_caches: list[torch.Tensor] | None = None) -> None:
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.tp = tp if tp is not None and tp.layout.size > 1 else None
        layout = self.tp.layout if self.tp is not None else None
        self.device = cfg.torch_device
        if layout is not None and self.device.type == "cuda":  # one device per rank (the worker's first N)
            self.device = torch.device("cuda", layout.rank)
            torch.cuda.set_device(self.device)
        if layout is not None and model is not None:
            raise ValueError("a tensor-parallel rank loads its own shard of the weights (model= cannot be shared)")
        self.num_heads = layout.heads if layout is not None else model_cfg.num_heads
        # what each layer keeps per token (engine/kv_spec.py), in the cache's format (engine/kv_quant.py)
        self.spec = dataclasses.replace(model_cfg.kv_spec, cache_dtype=cfg.kv_cache_dtype)
        self.kv_quant = parse_kv_cache_dtype(cfg.kv_cache_dtype)
        # (sink tokens, recent tokens): an opt-in bound on every sequence's keys (EngineConfig)
        self.bound = cfg.kv_bound
        if self.bound is not None and any(model_cfg.layer_windows):
            raise ValueError("kv_recent_tokens bounds the KV of models without sliding windows; this model's layers "
                             "already attend through windows")
        if self.kv_quant is not None and self.spec.head_dim % SCALE_BYTES:
            raise ValueError(f"kv_cache_dtype {cfg.kv_cache_dtype} needs rows of a multiple of {SCALE_BYTES} values; "
                             f"this model's are {self.spec.head_dim} wide")
        self.num_kv_heads = layout.kv_heads if layout is not None else self.spec.num_kv_heads
        self.dtype = cfg.torch_dtype(model_cfg)
        if cfg.num_threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.num_threads)
        self.max_model_len = resolve_max_model_len(model_cfg, cfg.max_model_len)
        self.model = model if model is not None else load_model(
            model_cfg, self.dtype, self.device, self.max_model_len, pack=not cfg.enforce_eager, layout=layout,
            reduce=self.tp.group.all_reduce if self.tp is not None else None)
        self.block_size = cfg.block_size
        self.num_blocks = self._num_blocks()
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"KV cache of {self.num_blocks} blocks x {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len {self.max_model_len}; raise num_blocks / kv_cache_memory_bytes or lower max_model_len"
            )
        shape = self.spec.layer_shape(self.num_blocks, self.block_size, self.num_kv_heads)
        # Zeroed, not empty: masked-out slots still enter the attention matmul with weight 0, and 0*NaN = NaN.
        # The caches of an engine this one replaces in the process (a role flip) are taken as they are when
        # they fit: their slots hold zeros or K/V written before (finite), as a freed block's do.
        fits = kv_caches is not None and len(kv_caches) == model_cfg.num_layers and all(
            c.shape == shape and c.dtype == self.cache_dtype and c.device == self.device for c in kv_caches)
        self.kv_caches = list(kv_caches) if fits else [torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
                                                       for _ in range(model_cfg.num_layers)]
        self._native = self._native_lib()
        if self.tp is not None and self.tp.is_leader:
            from engine.tp_ranks import handshake

            handshake(self.tp, self.num_blocks)  # the other ranks size their caches alike

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the KV cache tensors hold: the model's dtype, or bytes (quantized pages)."""
        return self.spec.storage_dtype(self.dtype)

    @property
    def native_decode(self) -> bool:
        """Whether decode attention runs the native kernel (a cache re-homed by
        DecodeEngine.move_kv_cache keeps its device, dtype and contiguous layers)."""
        return self._native is not None

    def _native_lib(self):
        """The native decode kernel where it serves this engine (CPU, float32/bf16, its size limits;
        K/V heads or a latent cache)."""
        m = self.model_cfg
        fits = self.spec.head_dim <= NATIVE_MAX_HEAD_DIM and self.block_size <= NATIVE_MAX_BLOCK
        # the kernel has no sink logit (gpt-oss): those models attend through torch
        if self.cfg.enforce_eager or m.attention_sinks or not fits or not native_decode_supported(self.kv_caches[0]):
            return None
        return native_lib()

    def _num_blocks(self) -> int:
        if self.cfg.num_blocks is not None:
            return self.cfg.num_blocks
        per_block = self.spec.bytes_per_token(self.dtype, self.num_kv_heads) * self.block_size
        budget = self.cfg.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.9)
            else:
                budget = CPU_DEFAULT_KV_BYTES
        return max(1, budget // per_block)

    @property
    def compat_hash(self) -> str:
        """The same whatever the tensor parallelism: KV travels with every head (engine/tp_steps.py)."""
        return self.model_cfg.compat_hash(self.dtype, self.block_size, self.spec)

    # ------------------------------------------------------------------ inputs
    def _prepare(self, batch: list[ScheduledSeq],
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[int | None, AttentionMetadata], list[int]]:
        """Token ids, positions, the attention metadata of each distinct window of the model's layers
        (None: full attention) and the rows to sample."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.completes:
                sample_rows.append(len(ids) - 1)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        ctx = [item.seq.num_computed_tokens + item.num_tokens for item in batch]
        windows = dict.fromkeys(self.model_cfg.layer_windows)
        metas = {w: self._attention(batch, ctx, slot_mapping, w) for w in windows}
        return input_ids, positions, metas, sample_rows

    def _attention(self, batch: list[ScheduledSeq], ctx: list[int], slot_mapping: torch.Tensor,
                   window: int | None) -> AttentionMetadata:
        """The metadata of the layers with `window`: each sequence's keys are those its queries see."""
        meta = AttentionMetadata(slot_mapping=slot_mapping, kv_quant=self.kv_quant)
        # decode rows (one new token) lead the batch; the native kernel takes them in mixed steps too
        n_dec = next((i for i, item in enumerate(batch) if item.num_tokens != 1), len(batch))
        first_span = 0
        if self._native is not None and n_dec:
            meta.native_decode = self._native_decode(batch[:n_dec], ctx[:n_dec], window)
            first_span = n_dec
        elif n_dec == len(batch):
            meta.decode_groups = self._decode_groups(batch, ctx, window)
            first_span = n_dec
        if first_span < len(batch):
            meta.spans = self._spans(batch[first_span:], ctx[first_span:], first_span, window)
            meta.native_prefill = self._native
        return meta

    def _key_blocks(self, table: list[int], first_query: int, end: int, window: int | None,
                    ) -> tuple[list[int], int, int]:
        """The blocks holding the keys seen by queries at positions [first_query, end), and where those
        keys lie in them: slots [lo, hi) of the blocks laid end to end. With a window the keys start
        at first_query - window + 1, and the blocks wholly before that (perhaps released) are left out."""
        bs = self.block_size
        if window is None and self.bound is not None:
            return self._bounded_blocks(table, first_query, end)
        first_key = 0 if window is None else max(0, first_query - window + 1)
        first_block = first_key // bs
        blocks = table[first_block: -(-end // bs)]
        assert blocks[0] >= 0, "a released KV block is inside an attention window"
        return blocks, first_key - first_block * bs, end - first_block * bs

    def _recent_start(self, query: int) -> int:
        """Under a KV bound, where the recent keys of the query at `query` begin: whole blocks."""
        return max(0, query - self.bound[1] + 1) // self.block_size * self.block_size

    def _bounded_blocks(self, table: list[int], first_query: int, end: int) -> tuple[list[int], int, int]:
        """_key_blocks under a KV bound: the sink blocks, then the blocks from the first query's
        recent start, laid end to end (every slot of them up to `end` is a key: the bound's edges
        are block boundaries, so the kernels need no gap)."""
        bs, (sinks, _) = self.block_size, self.bound
        recent = self._recent_start(first_query)
        if recent <= sinks:
            return table[: -(-end // bs)], 0, end
        blocks = table[: sinks // bs] + table[recent // bs: -(-end // bs)]
        assert min(blocks) >= 0, "a released KV block is inside a KV bound"
        return blocks, 0, sinks + end - recent

    def _bounded_positions(self, first_query: int, end: int) -> torch.Tensor:
        """The positions of _bounded_blocks' keys, in their order."""
        sinks, recent = self.bound[0], self._recent_start(first_query)
        if recent <= sinks:
            return torch.arange(end, device=self.device)
        return torch.cat([torch.arange(sinks, device=self.device), torch.arange(recent, end, device=self.device)])

    def _spans(self, batch: list[ScheduledSeq], ctx: list[int], q_start: int, window: int | None,
               ) -> list[SeqSpan]:
        bs, dev = self.block_size, self.device
        spans = []
        for item, c in zip(batch, ctx):
            n = item.num_tokens
            bounded = window is None and self.bound is not None and c > self.bound[1]  # else every key is seen
            windowed = window is not None and c > window  # some query's window starts after position 0
            kv_index = mask = None
            keys = c
            if c > n or windowed or bounded:  # a cached prefix (read through the block table), a window
                blocks, lo, hi = self._key_blocks(item.seq.block_table, c - n, c, window)  # or a bound: masked
                keys = hi - lo
                key_pos = (self._bounded_positions(c - n, c) if bounded
                           else torch.arange(c - keys, c, device=dev))[None, :]
                query_pos = torch.arange(c - n, c, device=dev)[:, None]
                mask = key_pos <= query_pos
                if windowed:
                    mask &= key_pos > query_pos - window
                if bounded:  # the sinks, and each query's recent blocks
                    recent = (query_pos - self.bound[1] + 1).clamp_min(0) // bs * bs
                    mask &= (key_pos < self.bound[0]) | (key_pos >= recent)
                if c > n:
                    table = torch.tensor(blocks, dtype=torch.long, device=dev)
                    kv_index = (table[:, None] * bs + torch.arange(bs, device=dev)).flatten()[lo:hi]
            plain = not (windowed or bounded)  # causal only: the native prefill kernel's case
            spans.append(SeqSpan(q_start, q_start + n, keys, kv_index, mask, c - n if plain else None))
            q_start += n
        return spans

    def _prompt_logprobs(self, batch: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """For sequences asking for prompt logprobs: the logprob of each prompt token this step's
        chunk predicts (row p predicts token p + 1), with the top alternatives, onto the sequence."""
        row = 0
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            n = seq.params.prompt_logprobs
            end = min(start + item.num_tokens, seq.num_prompt_tokens - 1)  # the last prompt row samples
            have = len(seq.prompt_logprobs)  # a preempted prompt is recomputed: its chunks may differ
            if n is not None and start <= have < end:
                first = row + have - start
                lp = torch.log_softmax(self.model.compute_logits(hidden[first:first + end - have]).float(), dim=-1)
                targets = seq.token_ids[have + 1:end + 1]
                picked = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
                ranks = ((lp > picked).sum(dim=-1) + 1).tolist()
                top_v, top_i = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
                seq.prompt_logprobs += [TokenLogprobs(t, v, list(zip(i, vs)), r) for t, v, i, vs, r in
                                        zip(targets, picked[:, 0].tolist(), top_i.tolist(), top_v.tolist(), ranks)]
            row += item.num_tokens

    def _native_decode(self, batch: list[ScheduledSeq], ctx: list[int], window: int | None) -> NativeDecode:
        keys = [self._key_blocks(item.seq.block_table, c - 1, c, window) for item, c in zip(batch, ctx)]
        width = max(len(blocks) for blocks, _, _ in keys)
        tables = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks, _, _ in keys],
                              dtype=torch.long)
        starts = torch.tensor([lo for _, lo, _ in keys], dtype=torch.long) if window is not None else None
        return NativeDecode(self._native, tables, torch.tensor([hi for _, _, hi in keys], dtype=torch.long),
                            torch.get_num_threads(), starts)

    def _decode_groups(self, batch: list[ScheduledSeq], ctx: list[int], window: int | None,
                       ) -> list[DecodeGroup]:
        """Split decode rows into groups of similar length so padding stays small.

        Rows are sorted by block count; a group grows while padding everything to its longest
        member costs at most DECODE_PAD_SLACK x the real blocks. One padded batch of short and long
        sequences together was measured 9x slower than this on a trace-like mix.
        """
        bs, dev = self.block_size, self.device
        keys = [self._key_blocks(item.seq.block_table, c - 1, c, window) for item, c in zip(batch, ctx)]
        order = sorted(range(len(batch)), key=lambda i: len(keys[i][0]))
        groups: list[list[int]] = []
        real = 0
        for i in order:
            n = len(keys[i][0])
            if groups and (len(groups[-1]) + 1) * n <= DECODE_PAD_SLACK * (real + n):
                groups[-1].append(i)
                real += n
            else:
                groups.append([i])
                real = n
        out = []
        for rows in groups:
            width = max(len(keys[i][0]) for i in rows)
            tables = torch.tensor([keys[i][0] + [0] * (width - len(keys[i][0])) for i in rows],
                                  dtype=torch.long, device=dev)
            lo = torch.tensor([keys[i][1] for i in rows], device=dev)[:, None]
            hi = torch.tensor([keys[i][2] for i in rows], device=dev)[:, None]
            slot = torch.arange(width * bs, device=dev)[None, :]
            mask = ((slot >= lo) & (slot < hi))[:, None, None, :]
            out.append(DecodeGroup(torch.tensor(rows, device=dev), tables, mask))
        return out

    def layer_kv(self, layer: int, blocks: list[int]) -> torch.Tensor | None:
        """`blocks`' K/V in `layer` with every KV head of the model (a copy). With tensor parallelism
        every rank calls it at once: rank 0 gets the heads gathered from all, the others None."""
        local = self.kv_caches[layer][:, blocks]
        return local if self.tp is None else self.tp.gather_heads(local)

    def kv_layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape `layer_kv` has for `num_blocks` blocks (all KV heads), what KV transfers carry."""
        return self.spec.layer_shape(num_blocks, self.block_size)

    def write_blocks(self, layer: int, blocks: list[int], kv: torch.Tensor, first_head: int = 0) -> None:
        """Write K/V of the model's KV heads [first_head, first_head + kv.shape[3]) (all of them:
        `kv_layer_shape`) into `blocks` of `layer`; with tensor parallelism each rank gets its heads of
        them (the other ranks through rank 0's channel)."""
        if self.tp is None:
            self.write_local(layer, blocks, kv, first_head)
            return
        own = self.tp.scatter_heads(layer, blocks, kv, first_head)
        if own is not None:
            self.write_local(layer, blocks, own[1], own[0])

    @torch.inference_mode()
    def write_local(self, layer: int, blocks: list[int], kv: torch.Tensor, head: int = 0) -> None:
        """K/V of this rank's heads [head, head + kv.shape[3]) (its own indices) into `blocks` of `layer`."""
        cache = self.kv_caches[layer]
        if head or kv.shape[3] != cache.shape[3]:
            if head < 0 or head + kv.shape[3] > cache.shape[3]:
                raise ValueError(f"KV heads [{head}, {head + kv.shape[3]}) outside this rank's {cache.shape[3]}")
            cache = cache[:, :, :, head:head + kv.shape[3]]
        copy_runs(cache, block_runs(blocks), kv.to(device=cache.device, dtype=cache.dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K and V, in every layer (a forked choice's copy),
        on every tensor-parallel rank."""
        if self.tp is not None:
            self.tp.leader.send(encode_copy(pairs))
        self.copy_local(pairs)

    @torch.inference_mode()
    def copy_local(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            cache.index_copy_(1, dst, cache.index_select(1, src))

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], layer_send: LayerSend | None = None) -> torch.Tensor:
        """One forward pass; returns float32 logits for each item that `completes`, in batch order."""
        blocks = layer_send.blocks if layer_send is not None else []
        parts = layer_send.parts if layer_send is not None else None
        if self.tp is not None:  # the other ranks run it with this one
            self.tp.leader.send(encode_step(batch, blocks, parts is not None),
                                bytes_tensor(parts.payload) if parts is not None else None)
        try:
            hidden, sample_rows = self.forward(batch, step_hook(self, blocks, parts, layer_send and layer_send.send))
            if parts is not None:
                settle_parts(self.tp.group if self.tp is not None else None, parts, self.device)
        except BaseException as e:
            if self.tp is None or isinstance(e, TPError):
                raise
            # the other ranks are inside this step's collectives: the group is out of step for good
            raise TPError(f"rank 0 failed in a tensor-parallel step ({e!r}); the ranks are out of step") from e
        self._prompt_logprobs(batch, hidden)
        if not sample_rows:
            return hidden.new_empty((0, self.model_cfg.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq], layer_hook: Callable[[int], None] | None = None,
                ) -> tuple[torch.Tensor, list[int]]:
        """The model over `batch` (its K/V written to the cache): the final hidden states and the rows to sample."""
        input_ids, positions, metas, sample_rows = self._prepare(batch)
        return self.model(input_ids, positions, metas, self.kv_caches, layer_hook), sample_rows
