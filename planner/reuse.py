"""What a workload's prefix reuse is worth: the routing policy's options on the command line, and
the lines `pdcluster plan` and `plan simulate` print for a workload whose requests name their
blocks (Mooncake traces).

    prefix     hit 21.8% of prompt tokens (an infinite cache shared by all workers: 28.4%); KV sent ...
    routing    prefix-aware against load only, the same requests (an infinite cache ...: 28.4% hit)
                                hit %  TTFT p50 ms  TTFT p90 ms  TPOT p50 ms  KV sent GB
                 prefix-aware    21.8         13.9         45.8         6.59         160
                    load only    21.3         11.8         44.9         6.58         164
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

from loadgen.metrics import percentile
from planner.cost_model import CostModel
from planner.plan import PlanContext, Pool
from planner.sim_cache import reuse_bound
from planner.simulator import ClusterSpec, SimResult, Simulator
from planner.workload import PlanWorkload


def add_routing_args(p: argparse.ArgumentParser, auto: bool) -> None:
    """`auto`: the threshold may be (and by default is) `auto`, each plan's from its cost model."""
    g = p.add_argument_group("routing (router/prefix_policy.py)")
    g.add_argument("--prefix-aware", choices=("on", "off"), default="on",
                   help="router.prefix_aware: choose workers by their cached prefixes as well as by load")
    g.add_argument("--local-prefill-uncached-tokens", type=_threshold if auto else int, default=None if auto else 0,
                   metavar="N|auto" if auto else "N",
                   help="router.local_prefill_uncached_tokens: a prompt whose part its decode worker does not "
                        "hold is at most this long is prefilled there (0: always a prefill worker" +
                        ("; auto, the default: each plan's own, the longest uncached part its decode worker "
                         "can prefill in one step that still meets the TPOT bound beside 8 running sequences)"
                         if auto else ")"))


def _threshold(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 0 or auto, got {text!r}")
    return n


def routing_of(args: argparse.Namespace) -> dict[str, Any]:
    """A Plan's (or SearchSpace's) routing fields from those options (None: auto)."""
    return {"prefix_aware": args.prefix_aware == "on", "local_prefill_uncached_tokens": args.local_prefill_uncached_tokens}


AUTO_THRESHOLD_BATCH = 8  # the decode batch `auto` keeps within the TPOT bound while prefilling


def plan_threshold(given: int | None, ctx: PlanContext, workload: PlanWorkload, slo: Any, decode: Pool,
                   mnbt: int) -> int:
    """A disaggregated plan's router.local_prefill_uncached_tokens: `given`, or for None (`auto`)
    what the cost model of its decode pool `decode` allows within the TPOT bound (`slo.tpot_ms`) at a
    batch of AUTO_THRESHOLD_BATCH sequences of the workload's mean context (prompt + half the
    output), in one step of at most `mnbt` tokens."""
    if given is not None:
        return given
    n = max(1, len(workload.prompts))
    context = round(sum(p + o / 2 for p, o in zip(workload.prompts, workload.outputs)) / n)
    return uncached_threshold(ctx.cost(decode, "decode"), slo.tpot_ms / 1e3, ctx.block_size, AUTO_THRESHOLD_BATCH,
                              context, mnbt)


def uncached_threshold(cost: CostModel, tpot_s: float, block_size: int, batch: int, context: int, cap: int) -> int:
    """The conditional-disaggregation threshold a decode worker's cost model suggests: the longest
    uncached part (whole blocks, at most `cap`: one step's token budget) that it can prefill in one
    mixed step beside `batch` running sequences of `context` tokens each while that step still
    meets the TPOT bound `tpot_s`. 0 when not even one block fits (always a prefill worker)."""
    decode = cost.decode_time(batch, batch * context)
    best = 0
    for u in range(block_size, cap + 1, block_size):
        attn = u * context + u * (u + 1) // 2  # the new tokens attend to the context and to each other
        if decode + cost.prefill_time(u, attn, context, 1) > tpot_s:
            break
        best = u
    return best


def hit_tokens(res: SimResult) -> int:
    """Prompt tokens the workers did not prefill: their prefix caches held them."""
    return sum(res.stats["cached_tokens"])


def _pct(x: float, total: float) -> float:
    return 100.0 * x / total if total else 0.0


def _p(xs: list[float], q: float) -> float:
    """The q-quantile of seconds `xs` in ms, as bench serve reports it (loadgen.metrics.percentile)."""
    v = percentile([x for x in xs if not math.isnan(x)], q * 100)
    return math.nan if v is None else v * 1e3


def reuse_lines(cluster: ClusterSpec, arrivals: Sequence[float], workload: PlanWorkload,
                block_keys: Sequence[Sequence[Hashable]], block_size: int, res: SimResult, compare: bool) -> list[str]:
    """`plan simulate`'s lines for a run `res` of `cluster`: its hits against the bound, and with
    `compare` the same requests routed by load only beside it."""
    bound = reuse_bound(arrivals, workload.prompts, block_keys, block_size)
    more = compare_routing(cluster, arrivals, workload.prompts, workload.outputs, block_keys, block_size,
                           done=res) if compare else []
    return [reuse_line(res, bound), *more]


def reuse_line(res: SimResult, bound: int) -> str:
    """One run's prefix-cache hits against the bound, and the KV that moved."""
    st = res.stats
    prompt = st["prompt_tokens"]
    line = (f"prefix     hit {_pct(hit_tokens(res), prompt):.1f}% of prompt tokens (an infinite cache shared by all "
            f"workers: {_pct(bound, prompt):.1f}%)")
    if st["kv_bytes_sent"] or st["kv_bytes_held"]:
        line += (f"; KV sent {st['kv_bytes_sent'] / 1e9:.3g} GB, {st['kv_bytes_held'] / 1e9:.3g} GB not sent "
                 "(held by the decode worker)")
    if st["local_uncached"]:
        line += f"; {st['local_uncached']} prompts prefilled on their decode worker (short uncached part)"
    if st.get("tier_hit_blocks"):
        line += f"; {st['tier_hit_blocks']} blocks read back from the offload tier"
    return line


def compare_routing(spec: ClusterSpec, arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
                    block_keys: Sequence[Sequence[Hashable]], block_size: int,
                    done: SimResult | None = None) -> list[str]:
    """The same requests through the cluster with prefix routing and by load only, side by side
    (`done`: the run with `spec` as it is, if there is one already)."""
    rows = []
    for on in (True, False):
        res = done if done is not None and spec.prefix_aware == on else Simulator(
            replace(spec, prefix_aware=on)).run(arrivals, prompts, outputs, block_keys=block_keys)
        rows.append(("prefix-aware" if on else "load only", res))
    prompt = sum(prompts)
    bound = reuse_bound(arrivals, prompts, block_keys, block_size)
    head = f"{'':>16}  {'hit %':>6}  {'TTFT p50 ms':>11}  {'TTFT p90 ms':>11}  {'TPOT p50 ms':>11}  {'KV sent GB':>10}"
    title = (f"routing    prefix-aware against load only, the same requests (an infinite cache shared by all "
             f"workers: {_pct(bound, prompt):.1f}% hit)")
    lines = [title, "           " + head]
    for name, res in rows:
        lines.append(f"           {name:>16}  {_pct(hit_tokens(res), prompt):6.1f}  {_p(res.ttft, 0.5):11.1f}  "
                     f"{_p(res.ttft, 0.9):11.1f}  {_p(res.tpot, 0.5):11.2f}  {res.stats['kv_bytes_sent'] / 1e9:10.3g}")
    return lines


def plan_reuse(cluster: ClusterSpec, workload: PlanWorkload, rate: float, block_size: int) -> list[str]:
    """`pdcluster plan`'s lines for the best plan at `rate`: what the workload's reuse is worth."""
    arrivals = workload.arrivals(rate)
    return [f"reuse at {rate:.3g} req/s, {len(workload)} requests:", *compare_routing(
        cluster, arrivals, workload.prompts, workload.outputs, workload.block_keys(block_size) or [], block_size)]
