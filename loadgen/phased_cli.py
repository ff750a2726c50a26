"""`pdcluster bench serve --phases`: one run per system through traffic whose mix shifts
(loadgen/phases.py), reported phase by phase: SLO attainment, TTFT/TPOT p90 and, against a
pdcluster endpoint, the worker-seconds of each role. Writes result.json, summary.md and the plots
of the whole run (as a plain run does), and phases.json / phases.md."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from common.heap import freeze_startup_heap
from loadgen.client import EndpointConfig
from loadgen.metrics import SLO, summarize
from loadgen.phases import PhasedRequests, WorkerSampler, parse_phases, phased_requests
from loadgen.report import RunReport, failure_lines, text_table, write_all
from loadgen.runner import run
from loadgen.workload import Workload, WorkloadConfig, load_workload

_NOT_WITH = ("rate", "rates", "time_scale")


def phase_rows(label: str, work: PhasedRequests, records: list, slo: SLO,
               sampler: WorkerSampler | None) -> list[dict[str, Any]]:
    """Per phase, then "all": requests, completed, attainment, TTFT/TPOT p90, worker-seconds per role."""
    rows = []
    spans = [*work.spans, ("all", work.spans[0][1], work.spans[-1][2])]
    for k, (name, start, end) in enumerate(spans):
        mine = [r for r, p in zip(records, work.phase) if name == "all" or p == k]
        s = summarize(mine, end - start, slo)
        rows.append({"system": label, "phase": name, "start_s": start, "end_s": end, "requests": len(mine),
                     "completed": s.completed, "slo_attainment": s.slo_attainment, "ttft_p90_ms": s.ttft_ms.p90,
                     "tpot_p90_ms": s.tpot_ms.p90,
                     "worker_seconds": sampler.worker_seconds(start, end) if sampler else {}})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("system", "phase", "requests", "ok", "SLO met", "TTFT p90 ms", "TPOT p90 ms", "worker-s (role)")
    body = []
    for r in rows:
        ws = ", ".join(f"{role} {v:.0f}" for role, v in sorted(r["worker_seconds"].items())) or "-"
        att = "-" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.1f}%"
        body.append((r["system"], r["phase"], str(r["requests"]), str(r["completed"]), att,
                     f"{r['ttft_p90_ms']:.0f}" if r["ttft_p90_ms"] is not None else "-",
                     f"{r['tpot_p90_ms']:.1f}" if r["tpot_p90_ms"] is not None else "-", ws))
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in (head, *body))


def run_phased(args: argparse.Namespace, argv: list[str], eps: list[EndpointConfig], slo: SLO,
               tokenizer: Any) -> int:
    given = [n for n in _NOT_WITH if getattr(args, n) is not None]
    if given or args.arrival != "poisson" or args.workload.startswith("multiturn"):
        what = f"--{given[0].replace('_', '-')}" if given else "--arrival" if args.arrival != "poisson" else "multiturn"
        raise ValueError(f"--phases gives the workloads, rates and arrivals (Poisson); {what} does not apply")
    from tqdm import tqdm

    phases = parse_phases(args.phases)
    base = WorkloadConfig("synthetic", 1, None, "rows", args.scale_lengths, args.max_context, args.max_output,
                          args.seed, args.synthetic_input, args.synthetic_output)
    loaded: list[Workload] = []

    def load(cfg: WorkloadConfig) -> Workload:
        loaded.append(load_workload(cfg, tokenizer, args.tokenizer))
        return loaded[-1]

    work = phased_requests(phases, base, load, args.seed)
    for k, (phase, w, (_, start, end)) in enumerate(zip(phases, loaded, work.spans)):
        n = work.phase.count(k)
        print(f"phase      {phase.label}, {start:g}-{end:g} s: {n} requests; " + "; ".join(w.describe()[1:2]))
    print(f"bounds     time limit {args.time_limit_s:g} s per run, request timeout {args.request_timeout_s:g} s; "
          f"SLO: {slo}", flush=True)
    description = "phases " + ", ".join(p.label for p in phases)
    whole = Workload("phases", None, "; ".join(dict.fromkeys(w.citation for w in loaded)), "synthetic",
                     description, work.requests, loaded[0].scaling)
    reports, rows = [], []
    bar = tqdm(total=len(eps) * len(work.requests), desc="bench serve", unit="req", disable=args.no_progress)
    try:
        for e in eps:
            freeze_startup_heap()
            bar.set_postfix_str(e.label)
            with WorkerSampler(e.url, e.api_key) as sampler:
                result = run(work.requests, work.offsets, e, e.model or "", args.time_limit_s,
                             lambda _rec: bar.update(), None, description)
            reports.append(RunReport(result, summarize(result.records, result.duration_s, slo)))
            rows += phase_rows(e.label, work, result.records, slo, sampler if sampler.samples else None)
    finally:
        bar.close()
    print(f"\nresults (client-side; {description})")
    print(text_table(reports))
    for line in failure_lines(reports):
        print("failures  ", line)
    print("\nper phase")
    print(table(rows))
    config = {**vars(args), "api_key": "(redacted)" if args.api_key else None,
              "command": "pdcluster bench serve " + shlex.join(argv), "arrival": description,
              "models": {e.label: e.model for e in eps}}
    out = Path(args.out)
    files = write_all(out, config, whole, reports)
    (out / "phases.json").write_text(json.dumps({"phases": [vars(p) for p in phases], "rows": rows}, indent=1))
    (out / "phases.md").write_text(f"Command: `{config['command']}`\n\n```\n{table(rows)}\n```\n")
    print("wrote " + ", ".join(str(f) for f in [*files, out / "phases.json", out / "phases.md"]))
    return 0 if any(r.summary.completed for r in reports) else 1
