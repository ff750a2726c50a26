"""Prefill worker: prompt batching and chunking, layer-wise KV push, first token."""

from prefill_worker.prefill_engine import PrefillEngine, PrefillResult

__all__ = ["PrefillEngine", "PrefillResult"]
