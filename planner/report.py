"""Outputs of `pdcluster plan`: the ranked table, a Pareto plot (cost against goodput), plan.json,
and the best plan as a ready cluster.yaml (checked by pdcluster.cluster_config before it is written).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from pdcluster.cluster_config import ClusterConfig
from planner.plan import Plan, PlanContext
from planner.search import Evaluation, SLOTarget, pareto


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table_rows(ranked: list[Evaluation], slo: SLOTarget, target: float | None) -> list[tuple[str, ...]]:
    p = f"p{slo.percentile:g}"
    head = ("#", "plan", "devices", "$/h", "kW", "goodput req/s", "req per $", f"TTFT {p} ms", f"TPOT {p} ms",
            "SLO att.")
    if target:
        head = head + (f"meets {target:g} req/s",)
    rows = [head]
    for i, e in enumerate(ranked, 1):
        row = (str(i), e.plan.label(), str(e.plan.devices()), f"{e.cost_per_hour:.2f}", f"{e.power_w / 1e3:.2f}",
               f"{e.goodput:.3g}", f"{e.goodput_per_dollar:.4g}", _f(e.ttft_ms), _f(e.tpot_ms),
               "-" if e.attainment is None else f"{e.attainment:.0%}")
        rows.append(row + (("yes" if e.meets_target else "no"),) if target else row)
    return rows


def kind(plan: Plan) -> str:
    """colocated, disaggregated (a fixed split) or disaggregated + local prefill."""
    if plan.mode == "colocated":
        return "colocated"
    return "disaggregated + local prefill" if plan.local_prefill_max_tokens else "disaggregated (fixed split)"


def why_mode(ranked: list[Evaluation]) -> str:
    """Why the best plan's kind of serving: each kind's best simulated plan beside it."""
    if not ranked:
        return ""
    best_of: dict[str, Evaluation] = {}
    for e in ranked:  # best first
        best_of.setdefault(kind(e.plan), e)
    top = ranked[0]
    parts = [f"{k}: {e.plan.label()} {e.goodput:.3g} req/s within the SLO, {e.goodput_per_dollar:.4g} req per $"
             for k, e in best_of.items()]
    return f"why {kind(top.plan)}: the best simulated plan of each kind: " + "; ".join(parts)


def text_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
                      *("| " + " | ".join(r) + " |" for r in rows[1:])])


def pareto_plot(path: Path, composed: list[Evaluation], ranked: list[Evaluation]) -> str | None:
    """Write the PNG; None, or why it was skipped."""
    try:
        import matplotlib
    except ImportError:
        return "Pareto plot skipped: matplotlib is not installed (pip install 'pdcluster[plots]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    est = [e for e in composed if e.goodput > 0]
    if est:
        ax.scatter([e.cost_per_hour for e in est], [e.goodput for e in est], s=8, color="0.75",
                   label="composed estimates")
        front_est = pareto(est)
        ax.plot([e.cost_per_hour for e in front_est], [e.goodput for e in front_est], color="0.45", lw=1, ls="--",
                drawstyle="steps-post", label="frontier of the estimates")
    for mode, color in (("disaggregated", "tab:blue"), ("colocated", "tab:orange")):
        pts = [e for e in ranked if e.plan.mode == mode and e.goodput > 0]
        if pts:
            ax.scatter([e.cost_per_hour for e in pts], [e.goodput for e in pts], s=28, color=color,
                       label=f"{mode} (simulated)")
    front = pareto([e for e in ranked if e.goodput > 0])
    if front:
        ax.plot([e.cost_per_hour for e in front], [e.goodput for e in front], color="black", lw=1,
                drawstyle="steps-post", label="Pareto frontier (simulated whole)")
    if ranked and ranked[0].goodput > 0:
        b = ranked[0]
        ax.scatter([b.cost_per_hour], [b.goodput], marker="*", s=180, color="tab:red", zorder=5,
                   label=f"best: {b.plan.label()}")
    ax.set_xlabel("cost ($/hour)")
    ax.set_ylabel("goodput (req/s within the SLO)")
    ax.set_title("plans: cost against goodput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _pool_name(role: str, hardware: str) -> str:
    name = "".join(c if c.isalnum() else "-" for c in f"{role}-{hardware}".lower()).strip("-")
    return name or role


def cluster_dict(plan: Plan, ctx: PlanContext, slo: SLOTarget, model_path: str, longest: int) -> dict[str, Any]:
    """The plan as a cluster.yaml mapping (pdcluster.cluster_config's layout)."""
    cpu = [ctx.hardware(p.hardware).is_cpu for p in plan.pools]
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = all(cpu) and all(p.count == 1 for p in plan.pools) and len(plan.pools) <= len(usable)
    roles = [("prefill", plan.prefill), ("decode", plan.decode)] if plan.mode == "disaggregated" \
        else [("colocated", plan.decode)]
    pools = []
    for i, (role, pool) in enumerate(roles):
        hw = ctx.hardware(pool.hardware)
        d: dict[str, Any] = {"name": _pool_name(role, pool.hardware), "role": role, "replicas": pool.count,
                             "hardware": "cpu" if hw.is_cpu else hw.name,
                             "resources": {"num_cpus": 1} if hw.is_cpu else {"num_cpus": 1, "num_gpus": pool.tp}}
        if pool.tp > 1:
            d["tensor_parallel_size"] = pool.tp
        if pool.ep:  # the engine's expert parallelism (docs/models.md); the header says where it differs
            d["expert_parallel"] = True
        if pin:
            d["cpus"] = [usable[i]]
        if plan.mode == "disaggregated":  # the SLO controller gives workers back below the planned traffic
            d.update(min_replicas=1, max_replicas=pool.count)
        pools.append(d)
    max_len = min(max(2048, 1 << max(0, (longest - 1).bit_length())), max(2048, ctx.model.max_context))
    return {
        "ray": {"address": None},
        "model": {"path": model_path, "dtype": "float32" if all(cpu) else ctx.dtype, "max_model_len": max_len},
        "mode": plan.mode,
        "router": {"host": "127.0.0.1", "grpc_port": 50051, "http_port": 8000, "api_keys": [],
                   **({"local_prefill_max_tokens": plan.local_prefill_max_tokens}
                      if plan.local_prefill_max_tokens else {}),
                   "prefix_aware": plan.prefix_aware,
                   "local_prefill_uncached_tokens": plan.local_prefill_uncached_tokens
                   if plan.mode == "disaggregated" else 0},
        "pools": pools,
        "kv_cache": {"block_size": ctx.block_size, "num_blocks": "auto", "memory_mb": 512 if all(cpu) else None,
                     "dtype": ctx.kv_cache_dtype, "offload_mb": ctx.kv_offload_mb},
        "engine": {"max_num_batched_tokens": plan.max_num_batched_tokens, "max_num_seqs": plan.max_num_seqs,
                   "enable_prefix_caching": True, "num_threads": 1 if all(cpu) else None},
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        # on: workers move between prefill and decode as the mix shifts (docs/controller.md)
        "controller": {"enabled": plan.mode == "disaggregated"},
    }


def write_cluster_yaml(path: Path, best: Evaluation, ctx: PlanContext, slo: SLOTarget, model_path: str,
                       longest: int, header: list[str]) -> ClusterConfig:
    d = cluster_dict(best.plan, ctx, slo, model_path, longest)
    cfg = ClusterConfig.from_dict(d)  # refuse to write a file `pdcluster up` would refuse
    lines = ["# written by `pdcluster plan` (planner/): the best plan found", *[f"# {h}" for h in header], ""]
    path.write_text("\n".join(lines) + yaml.safe_dump(d, sort_keys=False, default_flow_style=None))
    return cfg


def plan_json(path: Path, payload: dict[str, Any], ranked: list[Evaluation], composed: list[Evaluation]) -> None:
    def ev(e: Evaluation) -> dict[str, Any]:
        d = asdict(e)
        d["label"] = e.plan.label()
        d["goodput_per_dollar"] = e.goodput_per_dollar
        return d

    payload = {**payload, "ranked": [ev(e) for e in ranked],
               "composed": [ev(e) for e in composed if e.goodput > 0]}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
