"""Decode worker: KV receive into pre-allocated blocks, continuous-batching decode loop."""

from decode_worker.decode_engine import DecodeEngine

__all__ = ["DecodeEngine"]
