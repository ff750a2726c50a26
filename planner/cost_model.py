"""Step times of one worker: a roofline from the hardware's figures, or coefficients fitted to the engine.

A worker is `tp` devices of one hardware type running one engine. The simulator asks two things:

    prefill_time(sum_new, sum_attn, sum_prior, n_seqs)   one prefill step (a batch of prompt chunks)
    decode_time(batch, sum_context)                      one decode step (one token per sequence)

where, over the sequences of the step, sum_new = sum(n_i) new tokens, sum_prior = sum(p_i) tokens
already in the cache (chunked prompts, recomputation), sum_attn = sum(n_i * (p_i + n_i)) (query x key
pairs; sum(len^2) for whole prompts) and sum_context = sum(c_i) over decoding sequences.

Roofline (per step, on tp devices):

    FLOPs   = 2 * P_layers * tokens + 2 * L * q_dim * attn_pairs + 2 * P_lm_head * sampled
              (prefill: attn_pairs = sum_attn, causal; decode: attn_pairs = 2 * sum_context)
    bytes   = weight bytes + KV bytes read (prior or context) + KV bytes written (new tokens)
    compute = FLOPs / (tp * peak * compute_eff);  memory = bytes / (tp * bandwidth * memory_eff)
    TP      = 2 * L all-reduces of tokens * hidden * dtype bytes: ring 2 (tp-1)/tp * size / intra + latency
    time    = max(compute, memory) + TP + step_overhead

Fitted (the real engine, `pdcluster plan calibrate`):

    prefill = a + b * sum_new + c * sum_attn          (= a + b*sum(len) + c*sum(len^2) for whole prompts)
    decode  = a + b * sum_context + c * batch

KV capacity (tokens a worker's cache holds): roofline: (tp * memory * mem_util - weights) / KV bytes
per token; fitted: the calibrated engine's own block count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

from planner.catalog import Hardware
from planner.models import ModelShape

CPU_COEFFICIENTS = Path(__file__).with_name("cpu_coefficients.json")


class CostModel(Protocol):
    tp: int
    kv_capacity_tokens: int
    kv_bytes_per_token: int

    def prefill_time(self, sum_new: int, sum_attn: int, sum_prior: int = 0, n_seqs: int = 1) -> float: ...

    def decode_time(self, batch: int, sum_context: int) -> float: ...


@dataclass(frozen=True)
class RooflineParams:
    """Efficiency factors (fractions of peak) and fixed costs; defaults are typical of vLLM-class engines."""

    prefill_compute_eff: float = 0.6
    decode_compute_eff: float = 0.5
    memory_eff: float = 0.8
    mem_util: float = 0.9  # fraction of device memory for weights + KV cache
    activation_reserve: float = 0.05  # fraction of device memory kept for activations
    step_overhead_s: float = 1e-3  # scheduling, sampling, kernel launches per step
    allreduce_latency_s: float = 8e-6


@dataclass
class RooflineCostModel:
    hw: Hardware
    model: ModelShape
    tp: int = 1
    dtype_bytes: int = 2
    params: RooflineParams = field(default_factory=RooflineParams)

    def __post_init__(self) -> None:
        m, b = self.model, self.dtype_bytes
        self.kv_bytes_per_token = m.kv_bytes_per_token(b)
        self.weight_bytes = m.weight_bytes(b)
        self._layer_flops = 2.0 * m.matmul_params_per_token
        self._attn_flops = 2.0 * m.num_layers * m.q_dim
        self._lm_flops = 2.0 * m.vocab_size * m.hidden_size
        p = self.params
        self._compute_prefill = self.tp * self.hw.flops * p.prefill_compute_eff
        self._compute_decode = self.tp * self.hw.flops * p.decode_compute_eff
        self._bandwidth = self.tp * self.hw.mem_bw * p.memory_eff
        # weights are read once per step, by all tp devices together
        self._weight_read = (self.weight_bytes - m.embedding_params * b) / self._bandwidth
        usable = self.tp * self.hw.mem_bytes * (p.mem_util - p.activation_reserve) - self.weight_bytes
        self.kv_capacity_tokens = max(0, int(usable // self.kv_bytes_per_token))
        if self.tp > 1:
            ar_bytes = 2 * (self.tp - 1) / self.tp * m.hidden_size * b / (self.hw.intra_node_gbps * 1e9)
            self._tp_per_token = 2 * m.num_layers * ar_bytes
            self._tp_fixed = 2 * m.num_layers * p.allreduce_latency_s
        else:
            self._tp_per_token = self._tp_fixed = 0.0

    @property
    def fits(self) -> bool:
        """The weights fit, with room for at least one max-length sequence."""
        return self.kv_capacity_tokens >= min(self.model.max_context, 4096)

    def prefill_time(self, sum_new: int, sum_attn: int, sum_prior: int = 0, n_seqs: int = 1) -> float:
        flops = self._layer_flops * sum_new + self._attn_flops * sum_attn + self._lm_flops * n_seqs
        mem = self._weight_read + (sum_new + sum_prior) * self.kv_bytes_per_token / self._bandwidth
        comm = self._tp_fixed + self._tp_per_token * sum_new
        return max(flops / self._compute_prefill, mem) + comm + self.params.step_overhead_s

    def decode_time(self, batch: int, sum_context: int) -> float:
        flops = (self._layer_flops + self._lm_flops) * batch + self._attn_flops * 2 * sum_context
        mem = self._weight_read + (sum_context + batch) * self.kv_bytes_per_token / self._bandwidth
        comm = self._tp_fixed + self._tp_per_token * batch
        return max(flops / self._compute_decode, mem) + comm + self.params.step_overhead_s


@dataclass
class FittedCostModel:
    """Coefficients fitted to the real engine on one device (seconds; see `pdcluster plan calibrate`)."""

    prefill: tuple[float, float, float]  # a, b (per new token), c (per query-key pair)
    decode: tuple[float, float, float]  # a, b (per context token), c (per sequence)
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    tp: int = 1
    # measured decode steps (calibrate --from-bench: per batch-size bucket), rows of (mean batch,
    # mean seconds, context per sequence) by batch: where given, a step's time is interpolated
    # between them in batch (outside them: the nearest row's time plus or minus the fit's cost per
    # sequence), plus b per context token it attends to beyond the rows' context per sequence
    decode_table: tuple[tuple[float, float, float], ...] = ()

    def prefill_time(self, sum_new: int, sum_attn: int, sum_prior: int = 0, n_seqs: int = 1) -> float:
        a, b, c = self.prefill
        return a + b * sum_new + c * sum_attn

    def decode_time(self, batch: int, sum_context: int) -> float:
        a, b, c = self.decode
        rows = self.decode_table
        if not rows:
            return a + b * sum_context + c * batch
        (b0, t0, x0), (b1, t1, x1) = next(((r, q) for r, q in pairwise(rows) if batch <= q[0]), rows[-2:])
        if batch > b1:  # past the measured batches: the last row plus the fit's cost per sequence
            t, ctx = t1 + (batch - b1) * (c + b * x1), x1
        elif batch < b0:  # below them (a table without batch 1): the first row less as much
            t, ctx = t0 - (b0 - batch) * (c + b * x0), x0
        else:
            f = (batch - b0) / (b1 - b0) if b1 > b0 else 1.0
            t, ctx = t0 + f * (t1 - t0), x0 + f * (x1 - x0)
        return max(t + b * (sum_context - batch * ctx), 0.0)

    @property
    def fits(self) -> bool:
        return self.kv_capacity_tokens > 0


def load_coefficients(path: str | Path = CPU_COEFFICIENTS) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no calibrated coefficients; run `pdcluster plan calibrate`")
    return json.loads(path.read_text())


def live_for(coeffs: dict[str, Any], role: str) -> dict[str, Any] | None:
    """The step costs `pdcluster plan calibrate --serving-url` measured on a running cluster for a
    worker of `role` (prefill / decode: the disaggregated cluster's; colocated: the colocated one's)."""
    live = coeffs.get("live") or {}
    return live.get("colocated" if role == "colocated" else "decode")


def fitted_from(coeffs: dict[str, Any], role: str = "decode") -> FittedCostModel:
    """The calibrated engine for a worker of `role`. With live step costs for that role (measured
    under load, streaming and the serving path's share of the machine included) those; else the
    engine's own, plus what the zero-load serving probe measured per streamed token on top of a
    decode step (the worker's own gRPC stream of each token, on the worker's core) added to c
    (the rest of the serving path's CPU is the host's: ClusterSpec.host_cores)."""
    p, d = coeffs["prefill"], coeffs["decode"]
    per_token = (coeffs.get("serving") or {}).get("decode_token_s", 0.0)
    live = live_for(coeffs, role)
    if live is not None:
        p, d, per_token = live.get("prefill") or p, live["decode"], 0.0
    table = tuple(sorted((r["batch"], r["seconds"], r["context_per_seq"]) for r in d.get("table") or ()))
    return FittedCostModel((p["a"], p["b"], p["c"]), (d["a"], d["b"], d["c"] + per_token),
                           int(coeffs["kv_capacity_tokens"]), int(coeffs["kv_bytes_per_token"]),
                           decode_table=table if len(table) >= 2 else ())


def cost_model_for(hw: Hardware, model: ModelShape, tp: int = 1, dtype_bytes: int = 2,
                   coefficients: dict[str, Any] | None = None,
                   params: RooflineParams | None = None, role: str = "decode") -> CostModel:
    """Fitted coefficients for `cpu` (they must be for this model), else the roofline."""
    if hw.is_cpu and coefficients is not None:
        fitted_model = coefficients.get("model_shape", {})
        if fitted_model and fitted_model.get("name") != model.name:
            raise ValueError(f"the cpu coefficients were fitted on {fitted_model.get('name')!r}, not {model.name!r}; "
                             f"calibrate on it: `pdcluster plan calibrate --model CHECKPOINT_DIR` (a {model.name} checkpoint)")
        if tp != 1:
            raise ValueError("cpu workers have tp 1")
        return fitted_from(coefficients, role)
    if tp > hw.max_tp:
        raise ValueError(f"tp {tp} exceeds {hw.name}'s max_tp {hw.max_tp}")
    return RooflineCostModel(hw, model, tp, dtype_bytes, params or RooflineParams())

