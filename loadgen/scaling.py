"""Length scaling: one factor for prompt and output lengths (scripts/bench_engine.py uses it too).

    factor = F                                            (--scale-lengths F)
    factor = min(1, C / max_i(prompt_i + output_i))       (--max-context C: the longest request fits)
    factor = 1                                            (neither)

    prompt_i' = max(1, floor(prompt_i * factor))
    output_i' = min(O, max(1, floor(output_i * factor)))  (--max-output O caps outputs after scaling)

Mooncake's 512-token blocks scale with the lengths: block' = max(1, floor(512 * factor)).
The factor and the lengths before/after (min/median/max) are always returned and printed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LengthStats:
    min: int
    median: float
    max: int
    total: int

    @classmethod
    def of(cls, xs: list[int]) -> LengthStats:
        return cls(min(xs), statistics.median(xs), max(xs), sum(xs)) if xs else cls(0, 0, 0, 0)

    def __str__(self) -> str:
        return f"min {self.min}, median {self.median:g}, max {self.max} (sum {self.total})"


@dataclass
class Scaling:
    factor: float
    rule: str  # how the factor was chosen, in words
    max_context: int | None = None
    max_output: int | None = None
    block_tokens: int | None = None  # Mooncake: tokens per hash id after scaling
    prompt_before: LengthStats = field(default_factory=lambda: LengthStats(0, 0, 0, 0))
    prompt_after: LengthStats = field(default_factory=lambda: LengthStats(0, 0, 0, 0))
    output_before: LengthStats = field(default_factory=lambda: LengthStats(0, 0, 0, 0))
    output_after: LengthStats = field(default_factory=lambda: LengthStats(0, 0, 0, 0))

    def lines(self) -> list[str]:
        f = f"{self.factor:.4g}"
        out_rule = f"max(1, floor(output_i * {f}))"
        if self.max_output is not None:
            out_rule = f"min({self.max_output}, {out_rule})"
        out = [f"scaling    factor = {self.rule}" + ("" if self.rule.startswith("1 ") else f" = {f}"),
               f"           prompt_i = max(1, floor(prompt_i * {f}))",
               f"           output_i = {out_rule}"]
        if self.block_tokens is not None:
            out.append(f"           Mooncake block = max(1, floor(512 * {f})) = {self.block_tokens} token(s)")
        out += [f"  prompt before  {self.prompt_before}", f"  prompt after   {self.prompt_after}",
                f"  output before  {self.output_before}", f"  output after   {self.output_after}"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_factor(pairs: list[tuple[int, int]], max_context: int | None = None,
                  scale: float | None = None) -> tuple[float, str]:
    """(factor, rule in words) for (prompt, output) length pairs."""
    if max_context is not None and scale is not None:
        raise ValueError("give --max-context or --scale-lengths, not both")
    if scale is not None:
        if scale <= 0:
            raise ValueError(f"--scale-lengths must be > 0, got {scale}")
        return scale, "--scale-lengths"
    if max_context is not None:
        longest = max(p + o for p, o in pairs)
        rule = f"min(1, max_context {max_context} / longest prompt+output {longest})"
        return min(1.0, max_context / longest), rule
    return 1.0, "1 (no scaling)"


def scale_lengths(pairs: list[tuple[int, int]], factor: float, max_output: int | None = None,
                  max_context: int | None = None) -> tuple[list[int], list[int]]:
    """Scaled (prompts, outputs); raises when --max-context is too small for the max(1, .) floors."""
    prompts = [max(1, math.floor(p * factor)) for p, _ in pairs]
    outputs = [max(1, math.floor(o * factor)) for _, o in pairs]
    if max_output is not None:
        outputs = [min(max_output, o) for o in outputs]
    if max_context is not None:
        over = [i for i, (p, o) in enumerate(zip(prompts, outputs)) if p + o > max_context]
        if over:  # only possible when max_context is tiny and the max(1, .) floors kick in
            raise ValueError(f"--max-context {max_context} is too small for request(s) {over[:5]}")
    return prompts, outputs


def block_tokens(factor: float, block: int = 512) -> int:
    return max(1, math.floor(block * factor))
