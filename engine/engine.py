"""One engine = model runner + paged KV cache + scheduler + sampler, stepped in-process.

`step()` is schedule -> run -> sample -> postprocess. Prefill and decode workers each own an
`Engine` (role "prefill" hands a sequence off after its first token; role "decode"/"colocated"
keeps generating). Engines in one process may share the same weights (`model=`).
"""

from __future__ import annotations

from typing import Callable

from engine.block_manager import BlockManager
from engine.builtin_model import resolve_model_path
from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner, ScheduledSeq
from engine.models.llama import LlamaModel
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_stats import StepShape

ROLES = ("colocated", "prefill", "decode")
LayerHookFactory = Callable[[list[ScheduledSeq]], Callable[[int], None] | None]


def validate_request(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError naming the problem with a request (shared by engines and the router)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if len(token_ids) == 0:
        raise ValueError("prompt is empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens; max_model_len is {max_model_len} "
            "(the prompt must leave room for at least one generated token)"
        )
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        role: str = "colocated",
        model_cfg: ModelConfig | None = None,
        model: LlamaModel | None = None,
        seed: int = 0,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.cfg = cfg
        self.role = role
        self.model_cfg = model_cfg or ModelConfig.from_pretrained(resolve_model_path(cfg.model))
        self.runner = ModelRunner(self.model_cfg, cfg, model)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, cfg.max_num_batched_tokens, cfg.max_num_seqs, handoff_after_prefill=role == "prefill"
        )
        self.sampler = Sampler(self.runner.device, seed)
        self.last_step: StepShape | None = None  # the batch the last step() ran (None: it ran none)

    # ------------------------------------------------------------------ requests
    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem with a request."""
        validate_request(token_ids, params, self.model_cfg.vocab_size, self.max_model_len)

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

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self, hook_factory: LayerHookFactory | None = None) -> list[Sequence]:
        """Run one forward pass. Returns the sequences that received a token this step."""
        batch = self.scheduler.schedule()
        if not batch:
            self.last_step = None
            return []
        tokens = sum(item.num_tokens for item in batch)
        # one token per sequence is a decode step (a prompt's last chunk of one token counts as one)
        self.last_step = StepShape("decode" if tokens == len(batch) else "prefill", len(batch), tokens,
                                   sum(item.seq.num_computed_tokens for item in batch) + tokens)
        hook = hook_factory(batch) if hook_factory is not None else None
        logits = self.runner.run(batch, hook)
        completing = [item.seq for item in batch if item.completes]
        tokens, logprobs = self.sampler(logits, [s.params for s in completing], [s.sample_index for s in completing])
        return self.scheduler.postprocess(batch, tokens, logprobs)
