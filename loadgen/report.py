"""Outputs of `bench serve`: a JSON result file (config, scaling, per-request records, summaries),
a markdown summary, a text table for the terminal, and PNG plots (matplotlib, optional:
`pip install 'pdcluster[plots]'`; without it the plots are skipped with a message).

Plots: CDFs of TTFT and TPOT, one line per (system, rate); for a sweep of several rates, goodput
(when an SLO is set) and p99 TPOT against the request rate, one line per system.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.conversations import ConversationWorkload
from loadgen.metrics import Dist, Summary
from loadgen.runner import RunResult
from loadgen.workload import Workload

LAG_WARN_MS = 50.0  # p99 of (actual send - scheduled arrival) above this is reported


@dataclass
class RunReport:
    result: RunResult
    summary: Summary

    @property
    def name(self) -> str:
        return f"{self.result.label} @ {_rate(self.result.rate)}"


def _rate(rate: float | None) -> str:
    return "trace" if rate is None else ("inf" if math.isinf(rate) else f"{rate:g}") + " req/s"


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _pcts(d: Dist, keys: tuple[str, ...] = ("p50", "p90", "p99")) -> str:
    return "/".join(_f(getattr(d, k)) for k in keys)


def result_json(config: dict[str, Any], workload: Workload, runs: list[RunReport]) -> dict[str, Any]:
    about: dict[str, Any] = {}
    if isinstance(workload, ConversationWorkload):  # each record carries its conversation and turn
        about = {"conversations": len(workload.conversations), "think_time": workload.think,
                 "prompts": "token ids" if workload.token_ids else "text"}
    return {
        "config": config,
        "workload": {"name": workload.name, "path": workload.path, "source": workload.citation,
                     "kind": workload.kind, "selection": workload.selection,
                     "requests": len(workload.requests), **about,
                     "tokenizer": workload.tokenizer, "notes": workload.notes},
        "scaling": workload.scaling.to_dict(),
        "runs": [{"label": r.result.label, "url": r.result.url, "model": r.result.model,
                  "rate": r.result.rate,
                  "arrivals": r.result.arrivals, "started_at": r.result.started_at,
                  "stopped_by": r.result.stopped_by, "duration_s": r.result.duration_s,
                  "server_counters": r.result.server_counters,
                  "summary": r.summary.to_dict(), "records": [x.to_dict() for x in r.result.records]}
                 for r in runs],
    }


_HEAD = ("system", "rate", "ok/sent", "failed", "unfin.", "req/s", "out tok/s", "TTFT p50/p90/p99 ms",
         "TPOT p50/p90/p99 ms", "ITL p50/p99 ms", "e2e p50/p99 ms", "SLO att.", "goodput")
_TURNS_HEAD = ("TTFT turn 1 p50/p90/p99 ms", "TTFT turns 2+ p50/p90/p99 ms")


def _turns(runs: list[RunReport]) -> bool:
    return any(r.summary.ttft_first_turn_ms is not None for r in runs)


def _head(runs: list[RunReport]) -> tuple[str, ...]:
    """The table's columns: multi-turn runs add TTFT of the first turns and of the later ones."""
    return _HEAD[:8] + _TURNS_HEAD + _HEAD[8:] if _turns(runs) else _HEAD


def _row(r: RunReport, turns: bool = False) -> tuple[str, ...]:
    s = r.summary
    by_turn = tuple(_pcts(d) if d is not None else "-" for d in (s.ttft_first_turn_ms, s.ttft_later_turns_ms))
    return (r.result.label, _rate(r.result.rate), f"{s.completed}/{s.sent}", str(s.failed), str(s.unfinished),
            f"{s.request_throughput:.2f}", f"{s.output_throughput:.1f}", _pcts(s.ttft_ms),
            *(by_turn if turns else ()), _pcts(s.tpot_ms),
            _pcts(s.itl_ms, ("p50", "p99")), _pcts(s.e2e_ms, ("p50", "p99")),
            "-" if s.slo_attainment is None else f"{s.slo_attainment:.0%}", _f(s.goodput, ".2f"))


def text_table(runs: list[RunReport]) -> str:
    head = _head(runs)
    rows = [head, *(_row(r, _turns(runs)) for r in runs)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def failure_lines(runs: list[RunReport]) -> list[str]:
    out = []
    for r in runs:
        if r.summary.failures:
            kinds = ", ".join(f"{k}: {n}" for k, n in sorted(r.summary.failures.items()))
            first = next((x.error for x in r.result.records if not x.ok and x.error), "")
            out.append(f"{r.name}: {kinds} (first: {first[:160]})")
    return out


def run_notes(runs: list[RunReport]) -> list[str]:
    """Caveats a reader of the numbers must see."""
    out = []
    for r in runs:
        lag = r.summary.send_lag_ms.p99
        if lag is not None and lag > LAG_WARN_MS:
            out.append(f"{r.name}: p99 send lag {lag:.0f} ms: the client fell behind its arrival schedule "
                       "(a busy machine?), so the offered load was lower than asked for, and its times of "
                       "the answers are late by as much (on the server's machine: run the client in the "
                       "server's login session, see docs/bench_serve.md)")
    if any(r.summary.tokens_per_chunk_assumed for r in runs):
        out.append("some chunks carried no token count (no logprobs, and the chunk count differs from the usage): "
                   "each chunk was counted as one token for ITL; TPOT uses the server's usage")
    return out


def markdown(config: dict[str, Any], workload: Workload, runs: list[RunReport], plots: list[Path],
             notes: list[str]) -> str:
    slo = runs[0].summary.slo if runs else None
    lines = [f"# bench serve: {workload.name}", "",
             f"Command: `{config.get('command', '')}`", "",
             (f"Workload: {workload.name}, {len(workload.requests)} requests, {workload.selection}. "
              f"Source: {workload.citation}."), "",
             "```", *workload.describe(), "```", "",
             (f"Arrivals: {config.get('arrival')}; SLO: {slo}; "
              f"time limit {config.get('time_limit_s')} s per run, "
              f"request timeout {config.get('request_timeout_s')} s."), "",
             "| " + " | ".join(_head(runs)) + " |", "|" + "---|" * len(_head(runs))]
    lines += ["| " + " | ".join(_row(r, _turns(runs))) + " |" for r in runs]
    fails = failure_lines(runs)
    if fails:
        lines += ["", "Failures:", *[f"- {f}" for f in fails]]
    extra = [*notes, *run_notes(runs)]
    if extra:
        lines += ["", "Notes:", *[f"- {n}" for n in extra]]
    if plots:
        lines += ["", *[f"![{p.stem}]({p.name})" for p in plots]]
    lines += ["", ("Times are measured by the client (send to chunk arrival); latency columns in ms, "
                   "throughput per second of run duration (first send to last answer).")]
    return "\n".join(lines) + "\n"


def plots(out_dir: Path, runs: list[RunReport]) -> tuple[list[Path], str | None]:
    """Write the PNGs; (paths, None) or ([], why they were skipped)."""
    try:
        import matplotlib
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install 'pdcluster[plots]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)

    for metric, attr in (("TTFT", "ttft"), ("TPOT", "tpot")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in runs:
            xs = sorted(v * 1e3 for x in r.result.records if x.ok and (v := getattr(x, attr)) is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=r.name)
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{metric} CDF")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        save(fig, f"{attr}_cdf.png")
    rates = sorted({x for r in runs if (x := r.result.rate) is not None and not math.isinf(x)})
    if len(rates) > 1:
        panels = [("p99 TPOT (ms)", lambda s: s.tpot_ms.p99, "p99_tpot_vs_rate.png")]
        if runs[0].summary.goodput is not None:
            panels.insert(0, ("goodput (req/s)", lambda s: s.goodput, "goodput_vs_rate.png"))
        for ylabel, get, name in panels:
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for label in dict.fromkeys(r.result.label for r in runs):
                pts = sorted((r.result.rate, get(r.summary)) for r in runs
                             if r.result.label == label and r.result.rate in rates
                             and get(r.summary) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel} vs request rate")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
            save(fig, name)
    return written, None


def _finite(obj: Any) -> Any:
    """JSON has no Infinity/NaN: such floats become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_all(out_dir: Path, config: dict[str, Any], workload: Workload, runs: list[RunReport]) -> list[Path]:
    """result.json, summary.md and the plots under `out_dir`; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs, why = plots(out_dir, runs)
    notes = [why] if why else []
    payload = _finite(result_json(config, workload, runs))
    (out_dir / "result.json").write_text(json.dumps(payload, indent=1, default=str))
    (out_dir / "summary.md").write_text(markdown(config, workload, runs, pngs, notes))
    if why:
        print(why)
    return [out_dir / "result.json", out_dir / "summary.md", *pngs]
