"""What `pdcluster plan` says about the model and each pool's parallel layout, and the workload's
typical context (windowed layers hold at most their window of it)."""

from __future__ import annotations

import dataclasses
import statistics

from planner.model_shape import ModelShape
from planner.models import DTYPE_BYTES
from planner.parallel import allowed, describe
from planner.plan import Plan, PlanContext, Pool
from planner.workload import PlanWorkload


def typical_context(workload: PlanWorkload) -> int:
    """Tokens a sequence holds on average over its life: its prompt and half its output."""
    if not len(workload):
        return 1
    return max(1, round(statistics.fmean(p + o / 2 for p, o in zip(workload.prompts, workload.outputs))))


def model_lines(m: ModelShape, context: int | None = None) -> list[str]:
    """The model's size, attention and experts, one fact per clause."""
    kv = m.kv_bytes_per_token(2, context) / 1024
    at = f" at {context} tokens" if context and m.windowed_layers else ""
    if m.mla is not None:
        attn = (f"{m.num_heads} heads, latent attention (kv_lora_rank {m.mla.kv_lora_rank} + rope "
                f"{m.mla.qk_rope_head_dim} cached per token per layer)")
    else:
        attn = f"{m.num_heads} heads ({m.num_kv_heads} KV) x {m.head_dim}"
    lines = [f"model      {m.name}: {m.params / 1e9:.3g}B parameters, {m.num_layers} layers, {attn}; "
             f"KV {kv:g} KiB/token in 16-bit{at}"]
    e = m.experts
    if e is not None:
        shared = f" + {e.shared} shared" if e.shared else ""
        dense = f", {len(e.dense_layers)} dense layers" if e.dense_layers else ""
        lines.append(f"experts    {e.num} routed, top-{e.per_token}{shared} per MoE layer{dense}; "
                     f"{m.active_params / 1e9:.3g}B active parameters per token; weights "
                     f"{m.weight_bytes(2) / 1e9:.4g} GB" + (" (checkpoint's quantization)" if m.quantized else ""))
    if m.windowed_layers:
        lines.append(f"windows    {m.windowed_layers} of {m.num_layers} layers attend to the last "
                     f"{m.sliding_window} tokens" + (" (+ attention sinks)" if m.attention_sinks else ""))
    return lines


def default_layout(pool: Pool, ctx: PlanContext) -> Pool:
    """A pool given as N devices: tensor parallel where the rule allows it, else expert parallel."""
    m = ctx.model
    if pool.ep or m.is_dense:
        return pool
    ok = allowed(m, ctx.hardware(pool.hardware), pool.tp)
    return dataclasses.replace(pool, ep=True) if "tp" not in ok and "ep" in ok else pool


def parallel_lines(plan: Plan, ctx: PlanContext) -> list[str]:
    """Per pool of a mixture-of-experts or latent-attention plan: its layout and what it holds."""
    m = ctx.model
    if m.is_dense:
        return []
    roles = [("prefill", plan.prefill), ("decode", plan.decode)] if plan.prefill else [("colocated", plan.decode)]
    out = []
    for role, pool in roles:
        hw = ctx.hardware(pool.hardware)
        if hw.is_cpu:
            continue
        cost = ctx.cost(pool, role)
        other = [x for x in allowed(m, hw, pool.tp) if x != ("ep" if pool.ep else "tp")]
        alt = f" ({other[0]}{pool.tp} also allowed)" if other else ""
        text = describe(m, hw, pool.tp, pool.ep, DTYPE_BYTES[ctx.dtype], cost.kv_capacity_tokens)
        out.append(f"parallel   {role} {pool}: {text}{alt}")
    return out
