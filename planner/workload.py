"""The planner's requests: lengths from a trace (or synthetic), arrival times at any rate.

Lengths are read and scaled exactly as `pdcluster bench serve` does (loadgen.workload reads the
trace, loadgen.scaling applies --max-context / --scale-lengths / --max-output); no prompt text is
built. More requests than the trace has rows: the rows repeat in order (row i mod rows).

Arrivals at rate R (loadgen.arrivals): Poisson (seeded; the same draws at every rate, gaps scale as
1/R), gamma, or the trace's own timestamps rescaled so that the mean rate is R.

Shared prefixes (Mooncake traces): a row's `hash_ids` name its prompt's 512-token blocks, scaled to
`trace_block` tokens as `bench serve` builds the text (loadgen.workload). `block_keys(block_size)`
turns them into the simulator's prefix-cache keys: engine block j of a prompt stands for every token
up to its end, so its key is (the chain of hash ids up to the trace block holding its last token,
j); two requests share a key exactly when `bench serve` would send them the same text up to there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadgen.arrivals import ArrivalConfig, arrival_offsets
from loadgen.scaling import LengthStats, Scaling, block_tokens, choose_factor, scale_lengths
from loadgen.workload import MOONCAKE_BLOCK, LengthDist, read_trace, resolve_source


@dataclass
class PlanWorkload:
    name: str
    citation: str
    prompts: list[int]
    outputs: list[int]
    timestamps: list[float] | None  # the trace's offsets (None: synthetic)
    scaling: Scaling
    arrival: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0
    hash_ids: list[list[int]] | None = None  # per request, its trace blocks' ids (Mooncake)
    trace_block: int | None = None  # tokens per trace block after scaling

    def __len__(self) -> int:
        return len(self.prompts)

    def arrivals(self, rate: float) -> list[float]:
        stamps = self.timestamps if self.arrival == "trace" else None
        cfg = ArrivalConfig(self.arrival, rate, self.burstiness, None, self.seed)
        return arrival_offsets(cfg, len(self.prompts), stamps).offsets  # type: ignore[arg-type]

    def describe(self) -> list[str]:
        return [f"workload   {self.name}: {len(self)} requests; {self.citation}", *self.scaling.lines(),
                f"arrivals   {self.arrival}" + (f" (burstiness {self.burstiness:g})" if self.arrival == "gamma" else "")
                + f", seed {self.seed}"]

    def head(self, n: int) -> PlanWorkload:
        stamps = self.timestamps[:n] if self.timestamps is not None else None
        ids = self.hash_ids[:n] if self.hash_ids is not None else None
        return PlanWorkload(self.name, self.citation, self.prompts[:n], self.outputs[:n], stamps, self.scaling,
                            self.arrival, self.burstiness, self.seed, ids, self.trace_block)

    def block_keys(self, block_size: int) -> list[list[tuple[int, int]]] | None:
        """Per request, a prefix-cache key per full engine block of its prompt (None: no shared
        prefixes known, every prompt is its own)."""
        if self.hash_ids is None or not self.trace_block:
            return None
        keys = []
        for ids, prompt in zip(self.hash_ids, self.prompts):
            chain, h = [], 0
            for x in ids:
                h = hash((h, x))
                chain.append(h)
            row = []
            for j in range(prompt // block_size):
                m = ((j + 1) * block_size - 1) // self.trace_block  # the trace block of its last token
                row.append((chain[min(m, len(chain) - 1)], j))
            keys.append(row)
        return keys


def load_plan_workload(source: str, num_requests: int, max_context: int | None = None,
                       scale: float | None = None, max_output: int | None = None,
                       sample_seed: int | None = None, arrival: str = "poisson", burstiness: float = 1.0,
                       seed: int = 0, synthetic_input: str = "lognormal:512:0.5",
                       synthetic_output: str = "lognormal:128:0.5") -> PlanWorkload:
    if num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    name, path, citation = resolve_source(source)
    if path is None:
        rng = random.Random(f"{seed}:lengths")
        din, dout = LengthDist.parse(synthetic_input), LengthDist.parse(synthetic_output)
        pairs = [(din.sample(rng), dout.sample(rng)) for _ in range(num_requests)]
        stamps = None
        if arrival == "trace":
            raise ValueError("--arrival trace needs a trace workload")
        hash_ids = None
    else:
        _, rows_it = read_trace(path)
        rows = list(rows_it)
        if not rows:
            raise ValueError(f"{path}: the trace has no rows")
        if sample_seed is not None and num_requests < len(rows):
            idx = sorted(random.Random(sample_seed).sample(range(len(rows)), num_requests))
            rows = [rows[i] for i in idx]
        span = rows[-1].timestamp_s - rows[0].timestamp_s + 1.0  # one lap of the trace, when it repeats
        picked = [(rows[i % len(rows)], i // len(rows)) for i in range(num_requests)]
        t0 = picked[0][0].timestamp_s
        stamps = [r.timestamp_s - t0 + lap * span for r, lap in picked]
        pairs = [(r.input_len, r.output_len) for r, _ in picked]
        ids = [r.hash_ids for r, _ in picked]
        hash_ids = ids if all(ids) else None
    factor, rule = choose_factor(pairs, max_context, scale)
    prompts, outputs = scale_lengths(pairs, factor, max_output, max_context)
    trace_block = block_tokens(factor, MOONCAKE_BLOCK) if hash_ids is not None else None
    scaling = Scaling(factor, rule, max_context, max_output, trace_block,
                      LengthStats.of([p for p, _ in pairs]), LengthStats.of(prompts),
                      LengthStats.of([o for _, o in pairs]), LengthStats.of(outputs))
    return PlanWorkload(name, citation, prompts, outputs, stamps, scaling, arrival, burstiness, seed, hash_ids,
                        trace_block)
