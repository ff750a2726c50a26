"""A simulated request's state, and what a simulation records: per-request times, counters, the
early stop on SLO misses."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.sim_decode import SimDecodeWorker
    from planner.sim_prefill import SimPrefillWorker

NAN = float("nan")


class SimRequest:
    """One request on its way through the simulated cluster."""

    __slots__ = (
        "arrival",
        "blocks",
        "computed",
        "counted",
        "ctx_term",
        "d",
        "dhit",
        "done",
        "first_t",
        "held",
        "i",
        "join_k",
        "keys",
        "landed",
        "local",
        "need",
        "out",
        "p",
        "prompt",
        "tokens",
        "ver",
    )

    def __init__(self, i: int, arrival: float, prompt: int, out: int) -> None:
        self.i, self.arrival, self.prompt, self.out = i, arrival, prompt, out
        self.tokens = prompt  # prompt + generated
        self.done = 0  # output tokens generated
        self.computed = 0  # tokens of the current prefill whose KV is computed
        self.blocks = 0  # blocks held for a prefill in progress
        self.need = 0  # blocks reserved on the decode worker (disaggregated)
        self.local = False  # prefilled on its decode worker (local prefill), first token not yet out
        self.join_k = 0  # the decode worker's step count when it joined the running batch
        self.ctx_term = 0  # tokens at join - join_k (the batch's context aggregate)
        self.ver = 0  # bumped at each join and leave: stale finish entries are skipped
        self.p: SimPrefillWorker | None = None
        self.d: SimDecodeWorker | None = None
        self.first_t = NAN
        # a key per full block of its tokens, prompt first (planner.sim_cache); blocks past the
        # keys given are its own
        self.keys: Sequence[Hashable] = ()
        self.counted = 0  # prompt tokens the router counts queued on its prefill worker (uncached there)
        self.dhit = 0  # prompt tokens its decode worker held at the reservation (shared, no KV sent)
        self.held = 0  # leading blocks of its keys it holds in its decode worker's cache
        self.landed = False  # its prompt's KV is on its decode worker (committed or prefilled there)


class Outcomes:
    """Per request (by input index): TTFT, TPOT and e2e from arrival; the run's counters; `stop`
    once more than `max_misses` requests (of index >= `count_from`) miss the TTFT bound, or more
    than that many miss the TPOT bound."""

    def __init__(self, n: int, first_token_out_s: float, slo_ttft_s: float | None, slo_tpot_s: float | None,
                 max_misses: int | None, count_from: int, on_progress: Callable[[int], None] | None) -> None:
        self.ttft, self.tpot, self.e2e = [NAN] * n, [NAN] * n, [NAN] * n
        self.first_token_out_s = first_token_out_s
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.max_misses, self.count_from, self.on_progress = max_misses, count_from, on_progress
        self.stop = False
        self.finished = self.ttft_miss = self.tpot_miss = 0
        self.preemptions = self.prefill_steps = self.decode_steps = self.decode_seqs = self.local_prefills = 0
        self.local_uncached = 0  # of the local prefills, those by conditional disaggregation
        self.kv_bytes_sent = self.kv_bytes_held = 0  # KV transferred; not sent: its decode worker held it
        self.decode_step_s = self.prefill_step_s = 0.0
        self.decode_token_s = 0.0  # decode steps' time x the sequences each advanced (the gaps' sum)
        self.ttft_log: list[float] | None = None  # when a list: every TTFT, in the order they happen
        self.finish_log: list[tuple[int, int]] | None = None  # when a list: (prompt, output) of each finish
        self.last = 0.0  # the last finish
        self.in_system = 0  # requests arrived and not finished
        self.area = 0.0  # the integral of in_system over time

    def first_token(self, s: SimRequest, t: float) -> None:
        """`s`'s first token is sampled (committed) at `t`; it reaches the client first_token_out_s later."""
        s.first_t = t + self.first_token_out_s
        self.ttft[s.i] = s.first_t - s.arrival
        if self.ttft_log is not None:
            self.ttft_log.append(self.ttft[s.i])
        if self.slo_ttft_s is not None and self.ttft[s.i] > self.slo_ttft_s and s.i >= self.count_from:
            self.ttft_miss += 1
            if self.max_misses is not None and self.ttft_miss > self.max_misses:
                self.stop = True

    def finish(self, s: SimRequest, t: float) -> None:
        """`s`'s last token reaches the client at `t`."""
        self.e2e[s.i] = t - s.arrival
        if s.out > 1:
            self.tpot[s.i] = (t - s.first_t) / (s.out - 1)
            if self.slo_tpot_s is not None and self.tpot[s.i] > self.slo_tpot_s and s.i >= self.count_from:
                self.tpot_miss += 1
                if self.max_misses is not None and self.tpot_miss > self.max_misses:
                    self.stop = True
        self.finished += 1
        self.in_system -= 1
        if self.finish_log is not None:
            self.finish_log.append((s.prompt, s.out))
        self.last = max(self.last, t)
        if self.on_progress is not None:
            self.on_progress(1)
