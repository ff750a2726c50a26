"""One request's token state inside an engine.

A sequence's tokens are `prompt + generated`. `num_computed_tokens` counts the leading tokens whose
K/V are already in the paged cache; a step processes `token_ids[num_computed_tokens:]` (or a chunk
of it) and, once everything is computed, samples the next token from the last position's logits.
Prefill and decode are therefore the same operation with a different number of new tokens, and a
preempted sequence resumes by recomputing all of its tokens (prompt and generated ones).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no blocks yet (new, or preempted)
    RUNNING = "running"  # holds blocks, scheduled every step
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # the token's place in the vocabulary by logprob (1 = most likely); prompt tokens only


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 2048
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit length at the last allocation
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks (content-derived)
    num_registered_blocks: int = 0  # leading blocks of block_table already entered in the prefix cache
    # leading blocks of block_table given back while running, their keys outside every layer's sliding
    # window (their entries are RELEASED, engine/block_manager.py)
    num_released_blocks: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when it first left `waiting` (its queueing ended)
    # completion tokens generated before this sequence existed (a request resumed after a worker
    # failure: its prompt is the original prompt + those tokens); the first token sampled here is
    # completion token number `output_offset`, which is what a seeded draw depends on
    output_offset: int = 0
    guide: Any = None  # structured output: its matcher (engine/guided.py), made at its first sample
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. (params.prompt_logprobs)
    index: int = 0  # which choice of its request (SamplingParams.n / best_of); choice k > 0 is forked from 0
    forked: bool = False  # choice 0 of several: the other choices have been made

    def fork(self, index: int) -> Sequence:
        """Choice `index` of this sequence's request: its prompt and its own parameters, no blocks
        yet (BlockManager.fork shares the prompt's)."""
        return Sequence(
            request_id=self.request_id, token_ids=self.token_ids[: self.num_prompt_tokens],
            num_prompt_tokens=self.num_prompt_tokens, params=self.params.choice_params(index),
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time, index=index,
        )

    @property
    def forks(self) -> bool:
        """Whether the other choices of its request are still to be forked from this one."""
        return self.index == 0 and self.params.num_choices > 1 and self.output_offset == 0 and not self.forked

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def queue_ms(self) -> float:
        """Time waiting to be scheduled (so far, if it still waits)."""
        end = self.first_scheduled_time if self.first_scheduled_time is not None else time.monotonic()
        return (end - self.arrival_time) * 1e3

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_remaining(self) -> int:
        """Tokens whose K/V still have to be computed before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def sample_index(self) -> int:
        """Index in the whole completion of the next token to sample (seeded sampling uses it)."""
        return self.output_offset + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append a sampled token and decide whether the sequence is done."""
        self.token_ids.append(token_id)
        p = self.params
        # a constrained sequence's EOS (ignore_eos or not): its grammar is complete
        eos = (not p.ignore_eos or p.guided is not None) and token_id in self.eos_token_ids
        if eos or token_id in p.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_output_tokens >= p.max_tokens or len(self.token_ids) >= self.max_model_len:
            self.finish_reason = "length"
