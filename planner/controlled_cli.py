"""`pdcluster plan simulate --controller`: a cluster whose workers the SLO controller moves and adds
as the traffic shifts, replayed phase by phase in the simulator, side by side with a rule in the
style of Dynamo's load mode and with static clusters (planner/sim_controller.py).

    pdcluster plan simulate --controller --model Llama-3-8B --prefill H100-SXM:2 --decode H100-SXM:2 \\
        --phases azure-conv:40:3600,azure-code:20:3600,azure-conv:40:3600 --max-workers 32 --static 10+4

Each phase is WORKLOAD:RATE:SECONDS (Poisson arrivals at RATE for SECONDS, lengths from the workload
as `--workload` reads it); RATE may be A-B, a rate moving linearly from A to B over the phase (as a
day's traffic ramps). Printed per policy: SLO attainment (requests meeting TTFT and TPOT), per
phase, the share of `--window-s` windows in which at least 90% of the requests finishing there met
it, worker-hours, and the decisions made.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from loadgen.phases import parse_phases, thinned
from planner.sim_controller import ControlledResult, ControlledSimulator, load_rule
from scaling.policy import HOLD, Bounds, ControllerConfig, Decision


@dataclass
class Phased:
    arrivals: list[float]
    prompts: list[int]
    outputs: list[int]
    phase: list[int]  # each request's phase
    spans: list[tuple[str, float, float]]  # (label, start, end) per phase


def add_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("controller (with --controller)")
    c.add_argument("--controller", action="store_true", help="let the SLO controller move and add workers")
    c.add_argument("--phases", default=None, help="WORKLOAD:RATE:SECONDS,... the traffic, phase by phase "
                   "(RATE: a number, or A-B ramping linearly)")
    c.add_argument("--max-workers", type=int, default=16, help="workers in all, at most")
    c.add_argument("--min-workers", type=int, default=0,
                   help="workers in all, at least (= --max-workers: flips only, as a cluster of fixed size)")
    c.add_argument("--interval-s", type=float, default=10.0)
    c.add_argument("--start-s", type=float, default=60.0, help="a new worker serves this long after it is asked for")
    c.add_argument("--flip-s", type=float, default=1.0, help="a drained worker serves its new role this long after")
    c.add_argument("--static", action="append", default=[], metavar="P+D", help="also a static cluster of P+D workers")
    c.add_argument("--window-s", type=float, default=60.0)
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--scale-up-at", type=float, default=ControllerConfig.scale_up_at,
                   help="a role this close to its limit grows (the controller's band; docs/controller.md)")
    c.add_argument("--scale-down-at", type=float, default=ControllerConfig.scale_down_at)
    c.add_argument("--shrink-to", type=float, default=ControllerConfig.shrink_to)
    c.add_argument("--shrink-after-s", type=float, default=ControllerConfig.shrink_after_s,
                   help="a role that grew gives workers back no sooner than this after")
    c.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    c.add_argument("--slo-tpot-ms", type=float, default=50.0)


def phased(args: argparse.Namespace, load) -> Phased:
    """The phases' requests, back to back; `load(workload, n)` reads a workload's first n requests."""
    out = Phased([], [], [], [], [])
    t0 = 0.0
    for k, phase in enumerate(parse_phases(args.phases)):
        top = max(phase.rate_from, phase.rate_to)
        w = load(phase.workload, max(1, math.ceil(top * phase.seconds * 1.3) + 20))
        arrivals = list(w.arrivals(top))  # Poisson at the top rate, kept at rate(t) / top
        for i in thinned(phase, arrivals, f"{args.seed}:{k}"):
            out.arrivals.append(t0 + arrivals[i])
            out.prompts.append(w.prompts[i])
            out.outputs.append(w.outputs[i])
            out.phase.append(k)
        out.spans.append((phase.label, t0, t0 + phase.seconds))
        t0 += phase.seconds
    return out


def static_rule(cfg: ControllerConfig, b: Bounds, s, state):
    return Decision(HOLD, s.prefill, s.decode, "static"), state


def summary(name: str, r: ControlledResult, work: Phased, cfg: ControllerConfig, window_s: float) -> str:
    ok = [ttft <= cfg.slo_ttft_ms / 1e3 and (math.isnan(tpot) or tpot <= cfg.slo_tpot_ms / 1e3)
          for ttft, tpot in zip(r.ttft, r.tpot)]
    per = []
    for k in range(len(work.spans)):
        mine = [o for o, q in zip(ok, work.phase) if q == k]
        per.append(sum(mine) / len(mine) if mine else float("nan"))
    windows: dict[int, list[bool]] = {}
    for a, ttft, tpot, good in zip(work.arrivals, r.ttft, r.tpot, ok):
        windows.setdefault(int(a // window_s), []).append(good)
    met = sum(1 for v in windows.values() if sum(v) >= 0.9 * len(v)) / max(1, len(windows))
    return (f"{name:<16} {sum(ok) / max(1, len(ok)):7.1%}  " + "  ".join(f"{x:6.1%}" for x in per)
            + f"  {met:8.1%}  {r.worker_seconds / 3600:9.2f}  {r.decisions:5d}")


def run(args: argparse.Namespace, spec, worker, load) -> int:
    if not args.phases:
        raise ValueError("--controller needs --phases WORKLOAD:RATE:SECONDS,...")
    slo = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    cfg = ControllerConfig(interval_s=args.interval_s, scale_up_at=args.scale_up_at, scale_down_at=args.scale_down_at,
                           shrink_to=args.shrink_to, shrink_after_s=args.shrink_after_s,
                           urgent_at=max(ControllerConfig.urgent_at, args.scale_up_at), **slo)
    start = (len(spec.prefill), len(spec.decode))
    n = args.max_workers
    if sum(start) > n:
        raise ValueError(f"--max-workers {n} is fewer than the {sum(start)} workers the cluster starts with")
    if not 0 <= args.min_workers <= n:
        raise ValueError(f"--min-workers must be within 0 and --max-workers {n}, got {args.min_workers}")
    work = phased(args, load)
    print(f"phases     {', '.join(f'{label} ({end - begin:g} s)' for label, begin, end in work.spans)}: "
          f"{len(work.arrivals)} requests")
    print(f"SLO        TTFT <= {cfg.slo_ttft_ms:g} ms, TPOT <= {cfg.slo_tpot_ms:g} ms; at most {n} workers; "
          f"a new one serves after {args.start_s:g} s, a flip after {args.flip_s:g} s")
    header = (f"{'policy':<16} {'attained':>7}  " + "  ".join(f"{'ph' + str(k + 1):>6}" for k in range(len(work.spans)))
              + f"  {'windows':>8}  {'worker-h':>9}  {'dec.':>5}")
    print(header)
    policies = [(f"controller {start[0]}+{start[1]}", None, start), (f"load rule {start[0]}+{start[1]}", load_rule, start)]
    for s in args.static:
        p, _, d = s.partition("+")
        policies.append((f"static {s}", static_rule, (int(p), int(d))))
    from tqdm import tqdm

    timeline = []
    for name, rule, first in policies:
        kw = {} if rule is None else {"rule": rule}
        sim = ControlledSimulator(spec, worker, Bounds(1, n - 1, 1, n - 1, max(n, sum(first)), args.min_workers), first, cfg,
                                  flip_s=args.flip_s, start_s=args.start_s, **kw)
        with tqdm(total=len(work.arrivals), desc=name, unit="req", unit_scale=True, leave=False,
                  disable=args.no_progress, mininterval=0.5) as bar:
            r = sim.run(work.arrivals, work.prompts, work.outputs, on_progress=bar.update)
        print(summary(name, r, work, cfg, args.window_s))
        if rule is None:
            timeline = [i for i in r.intervals if i.decision != HOLD]
    print("controller's decisions:")
    for i in timeline:
        print(f"  {i.t:8.0f} s  {i.decision}  ({i.reason}); serving {i.prefill}+{i.decode}")
    return 0
