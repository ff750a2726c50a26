"""How a worker's devices share a model: tensor parallelism (TP) or expert parallelism (EP).

A worker is `degree` devices running one engine (Pool.tp). Two layouts:

- TP (degree t): every weight matrix is split t ways, experts along their intermediate size; two
  all-reduces of the hidden state per layer over NVLink. One node at most (t <= max_tp). Latent
  attention's cache is one latent per token shared by all heads, so it cannot be split by head:
  every rank holds all of it (t copies); GQA KV heads are copied when t exceeds them.
- EP (degree d): experts whole, E / d per device; attention, the dense layers, shared experts and
  embeddings data-parallel (a full copy on every device, each device decoding its share of the
  batch: DeepSeek's and SGLang's "DP attention"). Per MoE layer an all-to-all dispatches each
  token's hidden state to its k experts' devices and another combines the results: over NVLink
  within a node, over the NICs when d spans nodes. No all-reduce, one KV copy.

The rule (`allowed`): TP while t fits one node (t <= max_tp) and, for a MoE or latent-attention
model, the attention heads divide by t; EP for a MoE model when d >= 2 divides the routed experts
and is one node or whole nodes (d <= max_tp or d % max_tp == 0). Where both are allowed and the
weights (total params x bytes, EP: plus a copy of the non-expert part per device) and one longest
request fit, the search simulates each as its own candidate and keeps the one with more goodput
per dollar, per pool: the plan names it (`1x H200 ep8`). What the cost model makes of them: EP
reads the non-expert weights on every device (dearer at small batches) but keeps one KV copy and
replaces the per-layer all-reduces by all-to-alls of k vectors per MoE layer; for latent attention
at large decode batches, TP's KV copies take memory from the batch and time from every step, so
decode pools of DeepSeek favour EP; a model whose weights do not fit one node has EP across nodes
as its only layout.
"""

from __future__ import annotations

from planner.catalog import Hardware
from planner.model_shape import ModelShape


def allowed(model: ModelShape, hw: Hardware, degree: int) -> tuple[str, ...]:
    """The layouts (`tp`, `ep`) a worker of `degree` devices of `hw` may run (before memory)."""
    out = []
    if degree <= hw.max_tp and (model.is_dense or model.num_heads % degree == 0):
        out.append("tp")
    e = model.experts
    if e is not None and degree >= 2 and e.num % degree == 0 and (degree <= hw.max_tp or degree % hw.max_tp == 0):
        out.append("ep")
    return tuple(out)


def kv_copies(model: ModelShape, degree: int, ep: bool) -> int:
    """How many copies of each token's KV a worker holds. Dense models are left at one (as they
    have always been planned); under TP latent attention has one per rank and GQA one per rank that
    shares a KV head with another."""
    if ep or degree <= 1 or model.is_dense:
        return 1
    if model.mla is not None:
        return degree
    return max(1, degree // model.num_kv_heads)


def held_bytes(model: ModelShape, dtype_bytes: int, degree: int, ep: bool) -> float:
    """Weight bytes a worker holds over all its devices (EP: the non-expert part on each)."""
    total = model.weight_bytes(dtype_bytes)
    if not ep:
        return total
    routed = model.routed_expert_bytes(dtype_bytes)
    return degree * (total - routed) + routed


def engine_ep_gap(model: ModelShape, hw: Hardware, degree: int) -> str | None:
    """Why the engine cannot serve this EP pool with `expert_parallel: true` (None: it can). The
    engine's expert parallelism keeps attention tensor-parallel over ranks that are processes of one
    node, so the degree must fit a node and split the attention heads as TP's would."""
    if degree > hw.max_tp:
        return f"ep{degree} spans {-(-degree // hw.max_tp)} nodes; the engine's ranks are processes of one node"
    if model.num_heads % degree or (model.num_kv_heads % degree and degree % model.num_kv_heads):
        return (f"the engine's attention stays tensor-parallel under expert_parallel and cannot split "
                f"{model.num_heads} heads ({model.num_kv_heads} KV heads) {degree} ways")
    return None


def layout_label(degree: int, ep: bool) -> str:
    """' tp4', ' ep16', or '' for one device."""
    return f" ep{degree}" if ep else (f" tp{degree}" if degree > 1 else "")


def describe(model: ModelShape, hw: Hardware, degree: int, ep: bool, dtype_bytes: int,
             kv_capacity_tokens: int) -> str:
    """One line on a pool's layout: weights per device, KV room, the collective it pays."""
    per_device = held_bytes(model, dtype_bytes, degree, ep) / degree / 1e9
    nodes = -(-degree // hw.max_tp)
    if ep:
        e = model.experts
        link = "NVLink" if degree <= hw.max_tp else f"the NICs ({nodes} nodes)"
        how = (f"expert parallel: {e.num // degree} of {e.num} experts whole per device, attention "
               f"data-parallel, all-to-all per MoE layer over {link}")
    elif degree > 1:
        copies = kv_copies(model, degree, ep)
        how = "tensor parallel: every matrix split, 2 all-reduces per layer over NVLink" + (
            f"; KV held {copies}x (latent attention is not split by head)" if model.mla is not None and copies > 1
            else f"; KV heads copied {copies}x" if copies > 1 else "")
    else:
        how = "one device"
    return (f"{how}; weights {per_device:.1f} of {hw.hbm_gb:g} GB per device; "
            f"KV for {kv_capacity_tokens:,} tokens")
