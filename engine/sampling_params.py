"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 128  # n / best_of of one request


@dataclass(frozen=True)
class GuidedDecoding:
    """Structured output (engine/guided.py): what the completion must match.

    json: `spec` is a JSON schema (JSON text); json_object: any JSON object (`spec` empty); regex:
    `spec` is a regular expression; choice: `spec` is a JSON list of the strings allowed; grammar:
    `spec` is an EBNF grammar (xgrammar's, GBNF-like; the start rule is `root`)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided: kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("guided: a choice needs a JSON list of non-empty strings")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"guided: {self.kind} needs its spec")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature == 0 means greedy. `seed` makes sampling reproducible: the random draw for the
    i-th generated token depends only on (seed, i), so the same seed gives the same output whatever
    the batch, the worker, or a preemption in between.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token; None = off
    # logits adjustments (engine/logits_processors.py; vLLM's semantics)
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    min_tokens: int = 0  # no EOS / stop token / stop string before this many completion tokens
    guided: GuidedDecoding | None = None  # structured output: the completion matches this
    # each prompt token's logprob (after the first) plus this many top alternatives; None = off.
    # The prompt is then computed whole (no prefix-cache hits), as its logits are needed.
    prompt_logprobs: int | None = None
    # several choices from one prompt: `best_of` (None: n) are generated, the n of highest cumulative
    # logprob are returned. Choice k samples as a request with n = 1 and seed + k would (choice_params).
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"logit_bias: token ids must be integers >= 0, got {tok!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{tok}] must be in [-100, 100], got {bias}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        if self.best_of is not None and (not isinstance(self.best_of, int) or not self.n <= self.best_of <= MAX_CHOICES):
            raise ValueError(f"best_of must be an integer in [n, {MAX_CHOICES}] (n is {self.n}), got {self.best_of!r}")
        if self.min_tokens and self.guided is not None:  # the grammar's end allows EOS alone
            raise ValueError("min_tokens cannot be combined with structured output (guided): the output ends "
                             "where its grammar does")

    @property
    def num_choices(self) -> int:
        """Choices generated (best_of, or n)."""
        return self.best_of or self.n

    def choice_params(self, k: int) -> SamplingParams:
        """Choice k's own parameters: one choice, seed + k (choice 0 samples as the request with
        n = 1 would), no prompt logprobs after the first (the prompt is the same)."""
        seed = None if self.seed is None else (self.seed + k) % 2**64
        return dataclasses.replace(self, n=1, best_of=None, seed=seed,
                                   prompt_logprobs=self.prompt_logprobs if k == 0 else None)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
