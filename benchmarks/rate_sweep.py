"""A sweep of request rates over several systems side by side: one interleaved `pdcluster bench
serve` run, its result.json read back per system and rate, the SLO bar and the report's table."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

ATTAINMENT = 0.9  # "meets the SLO": at least this fraction of requests within both bounds

# a run's figure -> where bench serve's summary has it
FIGURES: dict[str, tuple[str, ...]] = {
    "attainment": ("slo_attainment",), "goodput": ("goodput",), "throughput": ("request_throughput",),
    "ttft_p50": ("ttft_ms", "p50"), "ttft_p90": ("ttft_ms", "p90"), "ttft_p99": ("ttft_ms", "p99"),
    "tpot_p50": ("tpot_ms", "p50"), "tpot_p99": ("tpot_ms", "p99"),
    "failed": ("failed",), "unfinished": ("unfinished",),
}


def run_bench_serve(urls: dict[str, str], workload_args: list[str]) -> int:
    """One `pdcluster bench serve` run over every endpoint (label = system name), interleaved."""
    from loadgen.cli import main as bench_serve

    argv_serve = [a for name, url in urls.items() for a in ("--endpoint", url, "--endpoint-label", name)]
    argv_serve += workload_args
    print("pdcluster bench serve " + " ".join(argv_serve), flush=True)
    return bench_serve(argv_serve)


def summarise(out: Path, analyse_fn: Callable[[dict], dict], report_fn: Callable[[dict, str], str],
              slo_text: str) -> int:
    """Read bench serve's result.json in `out`, write exp_summary.json / .md, print the report."""
    a = analyse_fn(json.loads((out / "result.json").read_text()))
    text = report_fn(a, slo_text)
    (out / "exp_summary.json").write_text(json.dumps(a, indent=2))
    (out / "exp_summary.md").write_text(text)
    print("\n" + text)
    return 0


def rate_table(result: dict, figures: tuple[str, ...]) -> dict[str, dict[float, dict]]:
    """{system: {rate: {figure: value}}} of a bench serve result, the figures in the order given."""
    table: dict[str, dict[float, dict]] = {}
    for run in result["runs"]:
        s = run["summary"]
        row = {}
        for name in figures:
            value: Any = s
            for key in FIGURES[name]:
                value = value[key]
            row[name] = value
        table.setdefault(run["label"], {})[run["rate"]] = row
    return table


def highest_rates(table: dict[str, dict[float, dict]], rates: list[float]) -> dict[str, float | None]:
    """Per system, the highest of `rates` at which it met the SLO (>= ATTAINMENT), or None."""
    return {name: max([r for r in rates if (t[r]["attainment"] or 0) >= ATTAINMENT], default=None)
            for name, t in table.items()}


def table_lines(a: dict, slo: str, systems: list[str]) -> list[str]:
    """The report's head and its table: per rate and system, attainment, goodput and latencies."""
    lines = [f"SLO: {slo}; a system meets it at a rate when >= {a['attainment_bar']:.0%} of requests do", "",
             "| rate (req/s) | system | SLO attainment | goodput (req/s) | TTFT p50 / p90 ms | TPOT p50 / p99 ms |",
             "|---|---|---|---|---|---|"]
    for r in a["rates"]:
        for name in systems:
            t = a["table"][name][str(r)]
            att = "-" if t["attainment"] is None else f"{t['attainment']:.0%}"
            lines.append(f"| {r:g} | {name} | {att} | {t['goodput'] or 0:.2f} | {t['ttft_p50']:.0f} / "
                         f"{t['ttft_p90']:.0f} | {t['tpot_p50']:.1f} / {t['tpot_p99']:.1f} |")
    return lines
