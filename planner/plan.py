"""A plan (pools of hardware, counts, tensor parallelism, batch limits) and the cluster it simulates as.

    plan = Plan("disaggregated", Pool("H100-SXM", 2, tp=1), Pool("A100-80GB", 3, tp=2))
    moe = Plan("disaggregated", Pool("H200", 1, tp=8, ep=True), Pool("H200", 2, tp=16, ep=True))
    ctx = PlanContext(model_shape("Llama-3-8B"), load_catalog())
    cluster = build_cluster(plan, ctx)     # a simulator.ClusterSpec
    plan.cost_per_hour(ctx.catalog)

Links: workers of different pools are on different nodes and a transfer goes over the NICs of the
tp devices of each side (inter_node_gbps x tp, the smaller side); `cpu` pools are this one machine
(intra_node_gbps, or the rate calibration measured). A worker that cannot hold its weights plus one longest request does not fit.

Serving overheads (router, HTTP, gRPC): for `cpu` those measured by calibration, if any
(coefficients["serving"]), and `cpu` workers share this machine's cores with the serving path
(ClusterSpec.host_cores); for GPUs `gpu_overheads` (defaults: 1 ms in, 1 ms out).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from planner.catalog import Hardware
from planner.cost_model import CostModel, RooflineParams, cost_model_for, live_for
from planner.models import DTYPE_BYTES, ModelShape
from planner.parallel import layout_label
from planner.simulator import ClusterSpec, WorkerSpec


@dataclass(frozen=True)
class Pool:
    hardware: str
    count: int
    tp: int = 1  # devices per worker
    ep: bool = False  # those devices run expert parallelism, not tensor parallelism (planner/parallel.py)

    def __str__(self) -> str:
        return f"{self.count}x {self.hardware}" + layout_label(self.tp, self.ep)


@dataclass(frozen=True)
class Plan:
    mode: str  # disaggregated | colocated
    prefill: Pool | None  # None in colocated mode
    decode: Pool  # the decode pool, or the colocated pool
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    local_prefill_max_tokens: int = 0  # disaggregated: router.local_prefill_max_tokens (0: a fixed split)
    prefix_aware: bool = True  # router.prefix_aware: workers chosen by their cached prefixes too
    local_prefill_uncached_tokens: int = 0  # disaggregated: router.local_prefill_uncached_tokens

    @property
    def pools(self) -> list[Pool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    def cost_per_hour(self, catalog: dict[str, Hardware]) -> float:
        return sum(p.count * p.tp * catalog[p.hardware].price_per_hour for p in self.pools)

    def power_w(self, catalog: dict[str, Hardware]) -> float:
        return sum(p.count * p.tp * catalog[p.hardware].power_w for p in self.pools)

    def devices(self) -> int:
        return sum(p.count * p.tp for p in self.pools)

    def label(self) -> str:
        if self.mode == "colocated":
            return f"colocated {self.decode}"
        local = f" + local prefill <= {self.local_prefill_max_tokens}" if self.local_prefill_max_tokens else ""
        if self.local_prefill_uncached_tokens:
            local += f" + uncached <= {self.local_prefill_uncached_tokens} on D"
        return f"P {self.prefill} | D {self.decode}{local}"

    def with_counts(self, n_prefill: int, n_decode: int) -> Plan:
        pre = dataclasses.replace(self.prefill, count=n_prefill) if self.prefill else None
        return dataclasses.replace(self, prefill=pre, decode=dataclasses.replace(self.decode, count=n_decode))


@dataclass(frozen=True)
class Overheads:
    router_in_s: float = 1e-3
    first_token_out_s: float = 1e-3
    token_out_s: float = 0.0
    kv_latency_s: float = 2e-4


@dataclass
class PlanContext:
    model: ModelShape
    catalog: dict[str, Hardware]
    dtype: str = "bfloat16"
    coefficients: dict[str, Any] | None = None  # fitted cpu coefficients
    roofline: RooflineParams = field(default_factory=RooflineParams)
    block_size: int = 16
    gpu_overheads: Overheads = field(default_factory=Overheads)
    kv_context: int | None = None  # typical tokens per sequence (windowed layers' share of the KV cache)
    kv_cache_dtype: str = "auto"  # the workers' kv_cache.dtype: auto, or quantized pages (int8, fp8_e4m3, fp8_e5m2)
    kv_offload_mb: int = 0  # kv_cache.offload_mb: the offload tier's size (simulated as one, shared by every worker)

    def hardware(self, name: str) -> Hardware:
        if name not in self.catalog:
            raise ValueError(f"unknown hardware {name!r}; known: {', '.join(self.catalog)}")
        return self.catalog[name]

    def cost(self, pool: Pool, role: str = "decode") -> CostModel:
        hw = self.hardware(pool.hardware)
        dtype_bytes = DTYPE_BYTES["float32"] if hw.is_cpu and self.coefficients else DTYPE_BYTES[self.dtype]
        return cost_model_for(hw, self.model, pool.tp, dtype_bytes, self.coefficients, self.roofline, role,
                              pool.ep, self.kv_context, self.kv_cache_dtype != "auto")

    def overheads(self, plan: Plan) -> Overheads:
        if all(self.hardware(p.hardware).is_cpu for p in plan.pools) and self.coefficients:
            s = self.coefficients.get("serving") or {}
            o = Overheads(s.get("router_in_s", 0.0), s.get("first_token_out_s", 0.0), s.get("token_out_s", 0.0),
                          s.get("kv_latency_s", 1e-3))
            fixed = self.idle_ttft_overhead(plan, o)
            if fixed is not None:  # measured on the running cluster: all of it before the first token's trip out
                o = dataclasses.replace(o, router_in_s=max(0.0, fixed - o.first_token_out_s))
            return o
        return self.gpu_overheads

    def idle_ttft_overhead(self, plan: Plan, o: Overheads) -> float | None:
        """The serving path's fixed share of a request's TTFT on a cpu cluster, from the TTFT a live
        calibration measured with one stream at several prompt lengths (planner.calibrate_serving:
        `idle_ttft_s`): the intercept of the line through (modelled prefill step, TTFT less the
        modelled KV transfer). The slope is not taken over: an idle prefill runs faster than the
        loaded ones the live prefill fit averages. None without such a measurement (or one length)."""
        idle = (live_for(self.coefficients or {}, plan.mode) or {}).get("idle_ttft_s") or {}
        if len(idle) < 2:
            return None
        pool = plan.prefill or plan.decode
        cost = self.cost(pool, "prefill" if plan.prefill else "colocated")
        xs, ys = [], []
        no_transfer = plan.mode == "colocated" or self.transfer_in_step(plan)
        for prompt, ttft in idle.items():
            n = int(prompt)
            transfer = 0.0 if no_transfer else (
                o.kv_latency_s + n * cost.kv_bytes_per_token / (self.link_gbps(pool) * 1e9))
            xs.append(cost.prefill_time(n, n * n, 0, 1))
            ys.append(ttft - transfer)
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return max(0.0, my - slope * mx)

    def transfer_in_step(self, plan: Plan) -> bool:
        """Whether the prefill workers' step costs already contain sending the KV and the commit:
        live ones (calibrate --serving-url / --from-bench) come from the workers' own step counters,
        and PrefillEngine.step is timed around the layer sends and the commit (its wait for the
        decode worker's lock too). The simulator then adds no transfer (ClusterSpec.transfer_in_step);
        where the fit took the lock wait out (calibrate_bench: `commit_wait_out`), it makes that wait
        (ClusterSpec.commit_waits_lock)."""
        return (plan.prefill is not None and self.hardware(plan.prefill.hardware).is_cpu
                and bool(self._live_prefill()))

    def commit_waits_lock(self, plan: Plan) -> bool:
        """Whether those prefill step costs had the commit's wait for the decode lock taken out."""
        return self.transfer_in_step(plan) and bool(self._live_prefill().get("commit_wait_out"))

    def _live_prefill(self) -> dict[str, Any]:
        """The disaggregated prefill workers' live step-cost fit ({} without one)."""
        return (live_for(self.coefficients or {}, "prefill") or {}).get("prefill") or {}

    def link_gbps(self, pool: Pool) -> float:
        hw = self.hardware(pool.hardware)
        if hw.is_cpu:
            measured = ((self.coefficients or {}).get("serving") or {}).get("kv_gbps")
            return measured or hw.intra_node_gbps
        return hw.inter_node_gbps * pool.tp


def worker_spec(plan: Plan, pool: Pool, ctx: PlanContext, role: str = "decode") -> WorkerSpec:
    """`role`: prefill, decode or colocated (which calibrated step costs a cpu worker gets)."""
    slope = 0.0
    if role != "decode" and ctx.hardware(pool.hardware).is_cpu:
        live = live_for(ctx.coefficients or {}, role) or {}
        slope = (live.get("prefill") or {}).get("load_slope", 0.0)
    return WorkerSpec(ctx.cost(pool, role), plan.max_num_batched_tokens, plan.max_num_seqs, ctx.block_size,
                      ctx.link_gbps(pool), pool.hardware, prefill_load_slope=slope)


def build_cluster(plan: Plan, ctx: PlanContext) -> ClusterSpec:
    o = ctx.overheads(plan)
    cpu = any(ctx.hardware(p.hardware).is_cpu for p in plan.pools)
    prefill = [worker_spec(plan, plan.prefill, ctx, "prefill")] * plan.prefill.count if plan.prefill else []
    decode = [worker_spec(plan, plan.decode, ctx, plan.mode if plan.mode == "colocated" else "decode")] * plan.decode.count
    # one CPU core has nothing to overlap a transfer with: it is sent after the step
    serving = ((ctx.coefficients or {}).get("serving") or {}) if cpu else {}
    # the serving path's CPU per token, less the part the decode worker spends on its own core
    # (decode_token_s, in its steps: cost_model.fitted_from); the rest (router, HTTP API, client)
    # floats over the host's cores. Kept for decode steps with live step costs too: they were
    # measured in closed loop, where the serving path asks less of the cores per step than under a
    # trace's arrivals. A live prefill step has its own fitted share instead (prefill_load_slope).
    # Step costs fitted to a trace's own runs (calibrate_bench: source "bench") have that share in them.
    host_cpu = max(0.0, serving.get("cpu_per_token_s", 0.0) - serving.get("decode_token_s", 0.0))
    if cpu and (live_for(ctx.coefficients or {}, plan.mode) or {}).get("source") == "bench":
        host_cpu = 0.0
    disaggregated = plan.mode == "disaggregated"
    local_uncached = plan.local_prefill_uncached_tokens if disaggregated else 0
    return ClusterSpec(plan.mode, prefill, decode, o.kv_latency_s, layerwise=not cpu, num_layers=ctx.model.num_layers,
                       router_in_s=o.router_in_s, first_token_out_s=o.first_token_out_s, token_out_s=o.token_out_s,
                       host_cores=serving.get("host_cores"), host_cpu_per_token_s=host_cpu,
                       transfer_in_step=ctx.transfer_in_step(plan),
                       commit_waits_lock=ctx.commit_waits_lock(plan),
                       local_prefill_max_tokens=plan.local_prefill_max_tokens if disaggregated else 0,
                       mixed_steps=disaggregated and (plan.local_prefill_max_tokens or local_uncached) > 0,
                       prefix_aware=plan.prefix_aware, local_prefill_uncached_tokens=local_uncached,
                       tier_blocks=tier_blocks(plan, ctx))


def tier_blocks(plan: Plan, ctx: PlanContext) -> int:
    """The offload tier's size in blocks of the decode pool's KV (0: no tier)."""
    if not ctx.kv_offload_mb:
        return 0
    return ctx.kv_offload_mb * 2**20 // (ctx.cost(plan.decode).kv_bytes_per_token * ctx.block_size)


def fits(pool: Pool, ctx: PlanContext, longest_tokens: int) -> bool:
    """The pool's workers hold the weights and at least one longest request."""
    return ctx.cost(pool).kv_capacity_tokens >= longest_tokens + ctx.block_size
