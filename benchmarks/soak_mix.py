"""The soak test's load: the mix of prompts (lengths, greedy or seeded sampling) and the tally of
what became of each request sent."""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Spec:
    """One prompt of the mix and how it is sampled."""

    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None  # None: greedy; else temperature 0.8 with this seed

    def sampling(self) -> dict[str, Any]:
        s: dict[str, Any] = {"max_tokens": self.max_tokens, "ignore_eos": True}
        s.update({"temperature": 0.0} if self.seed is None else {"temperature": 0.8, "seed": self.seed})
        return s


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    failed_clear: Counter = field(default_factory=Counter)  # reason -> count
    lost: list[str] = field(default_factory=list)  # what went wrong, per lost request
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.sent += 1
            if outcome == "ok":
                self.completed += 1
            elif outcome == "clear":
                self.failed_clear[detail] += 1
            else:
                self.lost.append(detail)


def make_specs(n: int, rng: random.Random) -> list[Spec]:
    out = []
    for i in range(n):
        length = rng.choice([4, 16, 60, 200, 500])
        prompt = tuple(rng.randrange(4, 4000) for _ in range(length))
        out.append(Spec(prompt, rng.choice([4, 16, 48, 96]), None if i % 3 else rng.randrange(1, 10**6)))
    return out
