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

Mixture of experts, latent attention, windows (planner/model_shape.py; dense models as above):

    P_layers  = the parameters a token multiplies: its top-k routed and the shared experts
    weights   = the non-expert part + per MoE layer the distinct experts the step's tokens touch,
                E (1 - (1 - k/E)^tokens) (batch 1 reads k experts, a large batch all E)
    attention = latent attention's own flops: prefill as the model computes it (K, V up-projected,
                heads x (qk_head_dim + v_head_dim) per pair), decode absorbed into the latent
                (heads x (2 (kv_lora_rank + rope) + 2 kv_lora_rank) per context token); windowed
                layers attend to and read at most the window of each sequence
    layouts   = TP or EP per worker (planner/parallel.py): EP reads the non-expert weights on every
                device and pays 2 all-to-alls per MoE layer (k hidden vectors per token, over NVLink,
                or the NICs across nodes) instead of the all-reduces; TP holds latent KV once per rank

Fitted (the real engine, `pdcluster plan calibrate`):

    prefill = a + b * sum_new + c * sum_attn          (= a + b*sum(len) + c*sum(len^2) for whole prompts)
    decode  = a + b * sum_context + c * batch

KV capacity (tokens a worker's cache holds): roofline: (tp * memory * mem_util - weights) / KV bytes
per token (x the copies a layout holds; windowed layers at the workload's typical context);
fitted: the calibrated engine's own block count.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

from planner.catalog import Hardware
from planner.models import ModelShape
from planner.parallel import allowed, held_bytes, kv_copies

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
    alltoall_latency_s: float = 2e-5  # one expert-parallel dispatch or combine


@dataclass
class RooflineCostModel:
    hw: Hardware
    model: ModelShape
    tp: int = 1  # devices per worker
    dtype_bytes: int = 2
    params: RooflineParams = field(default_factory=RooflineParams)
    ep: bool = False  # expert parallelism over the tp devices (planner/parallel.py)
    kv_context: int | None = None  # typical tokens per sequence, for windowed layers' share of the cache
    kv_quantized: bool = False  # the KV cache in quantized pages (kv_cache.dtype int8 / fp8: a byte a value)

    def __post_init__(self) -> None:
        m, b, p = self.model, self.dtype_bytes, self.params
        self.kv_bytes_per_token = m.kv_bytes_per_token(b, self.kv_context, self.kv_quantized)
        self.weight_bytes = m.weight_bytes(b)
        self._layer_flops = 2.0 * m.matmul_params_per_token
        self._attention_flops()
        self._lm_flops = 2.0 * m.vocab_size * m.hidden_size
        self._compute_prefill = self.tp * self.hw.flops * p.prefill_compute_eff
        self._compute_decode = self.tp * self.hw.flops * p.decode_compute_eff
        self._bandwidth = self.tp * self.hw.mem_bw * p.memory_eff
        copies = kv_copies(m, self.tp, self.ep)
        full, windowed = m.kv_split(b, self.kv_quantized)
        self._kv_full, self._kv_win, self._window = full * copies, windowed * copies, m.sliding_window
        # weights are read once per step, by all tp devices together (EP: the non-expert part by each)
        routed = m.routed_expert_bytes(b)
        dense_read = self.weight_bytes - m.embedding_params * b - routed
        self._weight_read = dense_read / (self.hw.mem_bw * p.memory_eff if self.ep else self._bandwidth)
        self._expert_read = m.moe_layers * m.expert_bytes(b) / self._bandwidth  # per distinct expert
        held = held_bytes(m, b, self.tp, self.ep)
        usable = self.tp * self.hw.mem_bytes * (p.mem_util - p.activation_reserve) - held
        self.kv_capacity_tokens = max(0, int(usable // (self.kv_bytes_per_token * copies)))
        self._tp_per_token = self._tp_fixed = 0.0
        if self.ep:
            self._expert_parallel()
        elif self.tp > 1:
            ar_bytes = 2 * (self.tp - 1) / self.tp * m.hidden_size * b / (self.hw.intra_node_gbps * 1e9)
            self._tp_per_token = 2 * m.num_layers * ar_bytes
            self._tp_fixed = 2 * m.num_layers * p.allreduce_latency_s

    def _attention_flops(self) -> None:
        """Per query-key pair (prefill, causal: the pairs are counted as a full square) and per
        context token (decode), for the layers without a window and for the windowed ones."""
        m = self.model
        windowed = m.windowed_layers
        full = m.num_layers - windowed
        if m.mla is not None:
            a = m.mla
            prefill, decode = m.num_heads * (a.qk_head_dim + a.v_head_dim), m.num_heads * (
                2 * a.latent_dim + 2 * a.kv_lora_rank)
        else:
            prefill, decode = 2 * m.q_dim, 4 * m.q_dim
        self._attn_flops, self._attn_dec = float(full * prefill), float(full * decode)
        self._attn_win, self._attn_win_dec = float(windowed * prefill), float(windowed * decode)

    def _expert_parallel(self) -> None:
        """Two all-to-alls per MoE layer, each moving k hidden vectors per token, (d-1)/d of them to
        other devices, every device sending its share: over NVLink within a node, else the NICs."""
        m, d, p = self.model, self.tp, self.params
        gbps = self.hw.intra_node_gbps if d <= self.hw.max_tp else self.hw.inter_node_gbps
        per_token = m.experts.per_token * m.hidden_size * self.dtype_bytes * (d - 1) / d / d
        self._tp_per_token = 2 * m.moe_layers * per_token / (gbps * 1e9)
        self._tp_fixed = 2 * m.moe_layers * p.alltoall_latency_s

    def _experts_read(self, tokens: int) -> float:
        e = self.model.experts
        return 0.0 if e is None else self._expert_read * e.distinct(tokens)

    @property
    def fits(self) -> bool:
        """The weights fit, with room for at least one max-length sequence."""
        return self.kv_capacity_tokens >= min(self.model.max_context, 4096)

    def prefill_time(self, sum_new: int, sum_attn: int, sum_prior: int = 0, n_seqs: int = 1) -> float:
        flops = self._layer_flops * sum_new + self._attn_flops * sum_attn + self._lm_flops * n_seqs
        mem = self._weight_read + (sum_new + sum_prior) * self._kv_full / self._bandwidth
        if self._kv_win:  # windowed layers: each new token attends to at most the window
            flops += self._attn_win * min(sum_attn, 2 * sum_new * self._window)
            mem += (sum_new + min(sum_prior, n_seqs * self._window)) * self._kv_win / self._bandwidth
        mem += self._experts_read(sum_new)
        comm = self._tp_fixed + self._tp_per_token * sum_new
        return max(flops / self._compute_prefill, mem) + comm + self.params.step_overhead_s

    def decode_time(self, batch: int, sum_context: int) -> float:
        flops = (self._layer_flops + self._lm_flops) * batch + self._attn_dec * sum_context
        mem = self._weight_read + (sum_context + batch) * self._kv_full / self._bandwidth
        if self._kv_win:  # windowed layers read at most the window of each sequence
            flops += self._attn_win_dec * min(sum_context, batch * self._window)
            mem += min(sum_context + batch, batch * self._window) * self._kv_win / self._bandwidth
        mem += self._experts_read(batch)
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
                   params: RooflineParams | None = None, role: str = "decode", ep: bool = False,
                   kv_context: int | None = None, kv_quantized: bool = False) -> CostModel:
    """Fitted coefficients for `cpu` (they must be for this model), else the roofline (`ep`: expert
    parallelism over the tp devices; `kv_context`: typical tokens per sequence, for windowed layers;
    `kv_quantized`: quantized KV pages, which change the bytes a token keeps and moves; on a fitted
    cpu model the capacity scales with them, the step times stay as measured)."""
    if hw.is_cpu and coefficients is not None:
        fitted_model = coefficients.get("model_shape", {})
        if fitted_model and fitted_model.get("name") != model.name:
            raise ValueError(f"the cpu coefficients were fitted on {fitted_model.get('name')!r}, not {model.name!r}; "
                             f"calibrate on it: `pdcluster plan calibrate --model CHECKPOINT_DIR` (a {model.name} checkpoint)")
        if tp != 1:
            raise ValueError("cpu workers have tp 1")
        fitted = fitted_from(coefficients, role)
        if kv_quantized:
            per_token = model.kv_bytes_per_token(dtype_bytes, kv_context, quantized=True)
            capacity = fitted.kv_capacity_tokens * fitted.kv_bytes_per_token // per_token
            fitted = dataclasses.replace(fitted, kv_capacity_tokens=capacity, kv_bytes_per_token=per_token)
        return fitted
    if not ep and tp > hw.max_tp:
        raise ValueError(f"tp {tp} exceeds {hw.name}'s max_tp {hw.max_tp}")
    if (ep or not model.is_dense) and ("ep" if ep else "tp") not in allowed(model, hw, tp):
        raise ValueError(f"{model.name} on {tp} {hw.name}: {'ep' if ep else 'tp'} not allowed "
                         f"(allowed: {', '.join(allowed(model, hw, tp)) or 'none'}; planner/parallel.py)")
    return RooflineCostModel(hw, model, tp, dtype_bytes, params or RooflineParams(), ep, kv_context, kv_quantized)

