"""One engine = model runner + paged KV cache + scheduler + sampler, stepped in-process.

`step()` is schedule -> run -> sample -> postprocess. Prefill and decode workers each own an
`Engine` (role "prefill" hands a sequence off after its first token; role "decode"/"colocated"
keeps generating). Engines in one process may share the same weights (`model=`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.admission_rule import prompt_fits
from engine.block_manager import BlockManager
from engine.builtin_model import resolve_model_path
from engine.cache_events import CacheChanges
from engine.config import EngineConfig, ModelConfig
from engine.guided import GuidedDecoder
from engine.kv_tier import TierLink, TierStats, open_tier
from engine.model_runner import LayerSend, ModelRunner, ScheduledSeq
from engine.models.llama import LlamaModel
from engine.request_checks import validate_request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_stats import StepShape
from engine.tp_group import TPError
from engine.tp_ranks import LocalRanks, check_expert_parallel
from engine.tp_steps import RankKV, TPContext

ROLES = ("colocated", "prefill", "decode")
LayerHookFactory = Callable[[list[ScheduledSeq]], LayerSend | None]


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    blocks_used: int
    blocks_free: int


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        role: str = "colocated",
        model_cfg: ModelConfig | None = None,
        model: LlamaModel | None = None,
        seed: int = 0,
        tp: TPContext | None = None,
        rank_kv: RankKV | None = None,
        kv_caches: list[torch.Tensor] | None = None,
    ) -> None:
        """`tp`: this engine is rank 0 of a tensor-parallel group whose other ranks run elsewhere;
        without it, `cfg.tensor_parallel_size` > 1 starts them here as child processes (engine/tp_ranks.py),
        each with `rank_kv` (its own KV sender or receiver: the direct KV path; None: through rank 0).
        `model`, `kv_caches`: the weights and KV cache tensors of an engine this one replaces in the process
        (a worker changing role): the weights are shared, the caches reused when they fit."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.cfg = cfg
        self.role = role
        self.model_cfg = model_cfg or ModelConfig.from_pretrained(resolve_model_path(cfg.model))
        check_expert_parallel(self.model_cfg, cfg.expert_parallel)
        self._ranks: LocalRanks | None = None
        self.tier = None
        if tp is None and cfg.tensor_parallel_size > 1:
            backend = "nccl" if cfg.torch_device.type == "cuda" else "gloo"
            self._ranks = LocalRanks(cfg, self.model_cfg, cfg.tensor_parallel_size, backend, rank_kv=rank_kv)
            tp = self._ranks.context
        self.rank_kv = rank_kv if self._ranks is not None else None
        try:
            self.runner = ModelRunner(self.model_cfg, cfg, model, tp, kv_caches)
        except BaseException:
            self.close()
            raise
        self.max_model_len = self.runner.max_model_len
        self.tier = open_tier(cfg, f"{self.runner.compat_hash}|{cfg.model}") if cfg.kv_offload_bytes else None
        link = TierLink(self.tier, lambda: self.runner.kv_caches) if self.tier is not None else None
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching, link)
        self.scheduler = Scheduler(
            self.block_manager, cfg.max_num_batched_tokens, cfg.max_num_seqs, handoff_after_prefill=role == "prefill",
            copy_blocks=self.runner.copy_blocks,
            kv_window=self.model_cfg.kv_spec.kv_window if cfg.kv_bound is None else cfg.kv_bound[1],
            kv_sink_blocks=0 if cfg.kv_bound is None else cfg.kv_bound[0] // cfg.block_size,
        )
        self.sampler = Sampler(self.runner.device, seed,
                               GuidedDecoder(resolve_model_path(cfg.model), self.model_cfg.vocab_size))
        self.last_step: StepShape | None = None  # the batch the last step() ran (None: it ran none)
        self.broken: str | None = None  # why the engine cannot step any more (a tensor-parallel rank failed)

    # ------------------------------------------------------------------ requests
    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem with a request."""
        validate_request(token_ids, params, self.model_cfg.vocab_size, self.max_model_len)
        if params.guided is not None:
            self.sampler.guided.check(params.guided)

    def make_sequence(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      output_offset: int = 0) -> Sequence:
        """`output_offset`: completion tokens generated elsewhere before (a resumed request, whose
        `token_ids` are its prompt plus those tokens); seeded sampling continues from there."""
        self.validate(token_ids, params)
        if output_offset < 0:
            raise ValueError(f"output_offset must be >= 0, got {output_offset}")
        return Sequence(
            request_id=request_id,
            token_ids=list(token_ids),
            num_prompt_tokens=len(token_ids),
            params=params,
            eos_token_ids=self.model_cfg.eos_token_ids,
            max_model_len=self.max_model_len,
            output_offset=output_offset,
        )

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    output_offset: int = 0) -> Sequence:
        seq = self.make_sequence(request_id, token_ids, params, output_offset)
        self.scheduler.add(seq)
        return seq

    def try_add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                        output_offset: int = 0) -> bool:
        """`add_request` if the prompt `fits` now (the rule of every admission that holds blocks:
        colocated requests, a decode worker's local prefills); False, and nothing added, otherwise."""
        if not self.fits(len(token_ids)):
            return False
        self.add_request(request_id, token_ids, params, output_offset)
        return True

    def abort(self, request_id: str, index: int | None = None) -> Sequence | None:
        """Drop the request (every choice, or choice `index`) and free its blocks."""
        return self.scheduler.abort(request_id, index)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ what the workers use
    # The worker engines (prefill_worker, decode_worker) and their servers go through these, never
    # through the block manager, scheduler or model runner.
    @property
    def compat_hash(self) -> str:
        """Two engines can exchange KV blocks only if theirs match (model, dtype, block size, layout)."""
        return self.runner.compat_hash

    @property
    def model(self) -> LlamaModel:
        """The loaded model (another engine in this process may share it)."""
        return self.runner.model

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """One tensor per layer: (2, num_blocks, block_size, num_kv_heads, head_dim)."""
        return self.runner.kv_caches

    @property
    def tensor_parallel(self) -> bool:
        """Whether the KV cache is split across ranks (then `kv_caches` holds rank 0's heads only)."""
        return self.runner.tp is not None

    @property
    def tensor_parallel_size(self) -> int:
        return self.runner.tp.layout.size if self.runner.tp is not None else 1

    def kv_layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's K/V of `num_blocks` blocks as transfers carry it: every KV head of the model."""
        return self.runner.kv_layer_shape(num_blocks)

    def write_kv(self, layer: int, block_ids: list[int], kv: torch.Tensor, first_head: int = 0,
                 local: bool = False) -> None:
        """K/V of the model's KV heads [first_head, first_head + kv.shape[3]) (all: `kv_layer_shape`)
        that arrived from elsewhere into `block_ids` of `layer`, each rank its heads of them; `local`:
        heads this rank holds, written here only (the direct path: the other ranks receive their own)."""
        if local:
            self.runner.write_local(layer, block_ids, kv, first_head - self.kv_heads[0])
            return
        try:
            self.runner.write_blocks(layer, block_ids, kv, first_head)
        except TPError as e:
            self.broken = str(e)
            raise

    @property
    def kv_heads(self) -> tuple[int, int]:
        """The model's index of the first KV head in `kv_caches`, and how many there are."""
        tp = self.runner.tp
        return (tp.layout.first_kv_head, tp.layout.kv_heads) if tp is not None else (0, self.model_cfg.num_kv_heads)

    @property
    def rank_info(self) -> list[list[int]]:
        """What each other tensor-parallel rank's `rank_kv` reported when it started (its receiver's port)."""
        return self.runner.tp.rank_info if self.runner.tp is not None and self.rank_kv is not None else []

    def call_ranks(self, request: dict) -> list[dict]:
        """Each other tensor-parallel rank's `rank_kv.call(request)`; a rank that does not answer breaks the engine."""
        if not self.rank_info:
            return []
        try:
            return self.runner.tp.call(request)
        except TPError as e:
            self.broken = str(e)
            raise

    def check_broken(self) -> str | None:
        """Why the engine cannot step (a tensor-parallel rank failed or exited), or None."""
        if self.broken is None and self._ranks is not None:
            gone = self._ranks.exited()
            if gone:
                self.broken = f"tensor-parallel rank {gone[0][0]} exited (code {gone[0][1]})"
        return self.broken

    def kv_description(self) -> str:
        """What this engine's cache keeps per token, as `pdcluster status` shows it:
        "heads:2x64x4 float32, 2048 B/token" (the whole model's, all ranks together)."""
        dtype = self.cfg.torch_dtype(self.model_cfg)
        spec = self.runner.spec
        return f"{spec.describe()} {str(dtype).removeprefix('torch.')}, {spec.bytes_per_token(dtype)} B/token"

    def rank_pids(self) -> list[int]:
        """The processes of this engine: its own, then its other tensor-parallel ranks'."""
        return [os.getpid(), *(p.pid for p in (self._ranks.processes if self._ranks is not None else []))]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the tensor-parallel ranks this engine started (nothing else needs closing); a rank
        still alive after `timeout_s` is killed."""
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        if self._ranks is not None:
            self._ranks.close(0.0 if self.broken else timeout_s)  # broken: the others may sit in a collective
            self._ranks = None

    def replace_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """Serve from `caches` (same shapes, contents copied by the caller), e.g. shared memory."""
        old = self.runner.kv_caches
        if len(caches) != len(old) or any(c.shape != o.shape or c.dtype != o.dtype for c, o in zip(caches, old)):
            raise ValueError("replacement KV caches must match the current ones in number, shape and dtype")
        self.runner.kv_caches = list(caches)

    def fits(self, num_tokens: int) -> bool:
        """A new prompt of `num_tokens` fits in the free blocks, keeping one block of headroom per
        running sequence so that new prompts do not starve decode (reservations, local prefills,
        colocated admissions: one rule, engine/admission_rule.py)."""
        bm = self.block_manager
        return prompt_fits(num_tokens, bm.block_size, len(self.scheduler.running), bm.num_free_blocks)

    def allocate_blocks(self, num_tokens: int) -> list[int]:
        """Fresh, unshared blocks for `num_tokens` (KV that arrives from elsewhere goes there)."""
        return self.block_manager.allocate_blocks(num_tokens)

    def allocate_cached(self, seq: Sequence) -> int:
        """Blocks for all of `seq`'s tokens: its leading full blocks from the prefix cache where they
        are there (shared, never written), fresh ones for the rest, in ascending order (KV that
        arrives from elsewhere goes there). Returns the number of tokens served from the cache."""
        self.block_manager.allocate(seq)
        return seq.num_cached_tokens

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block's K and V over every layer (every KV head, whatever the tensor parallelism)."""
        c = self.runner.kv_caches[0]
        return len(self.runner.kv_caches) * math.prod(self.kv_layer_shape(1)) * c.element_size()

    def prefix_cache_changes(self, cursor: int) -> CacheChanges:
        """What the prefix cache stored and evicted since `cursor` (engine/cache_events.py)."""
        return self.block_manager.events.since(cursor)

    def in_prefix_cache(self, h: bytes) -> bool:
        """Whether a block of this hash is in the prefix cache now (a hint: safe from any thread)."""
        return h in self.block_manager.hash_to_block

    def tier_changes(self, cursor: int) -> CacheChanges | None:
        """What the offload tier gained and lost since `cursor` (None: no tier); engine/kv_tier.py."""
        return self.tier.changes(cursor) if self.tier is not None else None

    @property
    def tier_id(self) -> str:
        """The offload tier's name, the same for every engine sharing it ("" without one)."""
        return self.tier.tier_id if self.tier is not None else ""

    def tier_stats(self) -> TierStats | None:
        """The offload tier's size and this engine's saves, hits, misses and evictions (safe from any thread)."""
        return self.tier.snapshot_stats() if self.tier is not None else None

    def cache_computed(self, seq: Sequence) -> None:
        """Enter `seq`'s full blocks whose K/V are computed (or arrived) into the prefix cache."""
        self.block_manager.cache_full_blocks(seq)

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks (one the scheduler does not hold)."""
        self.block_manager.free(seq)

    def has_room(self) -> bool:
        """Whether one more sequence may join the batch (max_num_seqs; waiting ones count)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting) < self.scheduler.max_num_seqs

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose prompt KV is already in its blocks joins the running batch."""
        self.scheduler.add_running(seq)

    def queued_prompt_tokens(self, include_running: bool = False) -> int:
        """Prompt tokens not yet computed: of waiting sequences, and of running ones (whose prompts
        are being chunked) with `include_running`. Call from the thread that steps the engine."""
        seqs = [*self.scheduler.waiting, *self.scheduler.running] if include_running else self.scheduler.waiting
        return sum(s.num_remaining for s in seqs)

    def load(self) -> EngineLoad:
        """Sizes read live (safe from any thread)."""
        bm = self.block_manager
        return EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_used_blocks,
                          bm.num_free_blocks)

    # ------------------------------------------------------------------ stepping
    def step(self, hook_factory: LayerHookFactory | None = None) -> list[Sequence]:
        """Run one forward pass. Returns the sequences that received a token this step."""
        return self._step(hook_factory, None)

    def step_with_rows(self) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """`step()`, and the batch it ran: per scheduled sequence, (tokens computed before the step,
        tokens the step computed) -- the shape a step's cost is fitted to (planner/calibrate.py)."""
        rows: list[tuple[int, int]] = []
        return self._step(None, rows), rows

    def _step(self, hook_factory: LayerHookFactory | None, rows: list[tuple[int, int]] | None) -> list[Sequence]:
        if self.check_broken() is not None:
            raise TPError(self.broken)
        batch = self.scheduler.schedule()
        if not batch:
            self.last_step = None
            return []
        if rows is not None:
            rows.extend((item.seq.num_computed_tokens, item.num_tokens) for item in batch)
        tokens = sum(item.num_tokens for item in batch)
        # one token per sequence is a decode step (a prompt's last chunk of one token counts as one)
        self.last_step = StepShape("decode" if tokens == len(batch) else "prefill", len(batch), tokens,
                                   sum(item.seq.num_computed_tokens for item in batch) + tokens)
        hook = hook_factory(batch) if hook_factory is not None else None
        try:
            logits = self.runner.run(batch, hook)
            completing = [item.seq for item in batch if item.completes]
            tokens, logprobs = self.sampler(logits, [s.params for s in completing],
                                            [s.sample_index for s in completing], completing)
            return self.scheduler.postprocess(batch, tokens, logprobs)  # (a fork's block copies reach every rank)
        except TPError as e:  # the group is gone: so is this engine (its worker restarts as a whole)
            self.broken = str(e)
            raise
