"""Decode worker: KV received into pre-allocated blocks, continuous-batching decode loop; and the
colocated worker, whose engine runs both phases. Both serve the DecodeWorker gRPC service."""

from decode_worker.decode_engine import DecodeEngine

__all__ = ["DecodeEngine"]
