"""An engine that replaces another in the process (a worker changing role) takes its KV cache
tensors when they fit, instead of allocating (engine/model_runner.py), and a decode worker's cache
moved into shared memory while it holds nothing is not copied (decode_worker/decode_engine.py)."""

from __future__ import annotations

import torch

from engine import EngineConfig
from engine.engine import Engine


def test_fitting_caches_are_taken_and_others_are_not(checkpoint):
    cfg = EngineConfig(model=str(checkpoint("llama-gqa")), dtype="float32", num_blocks=32, max_model_len=128)
    first = Engine(cfg, "prefill")
    caches = first.runner.kv_caches
    caches[0].fill_(1.5)  # K/V written before: finite values, as a freed block holds
    again = Engine(cfg, "decode", model=first.runner.model, kv_caches=caches)
    assert [c.data_ptr() for c in again.runner.kv_caches] == [c.data_ptr() for c in caches]
    other = Engine(EngineConfig(model=cfg.model, dtype="float32", num_blocks=48, max_model_len=128), "decode",
                   model=first.runner.model, kv_caches=caches)  # another shape: its own, zeroed
    assert other.runner.kv_caches[0].shape[1] == 48 and not other.runner.kv_caches[0].any()
    assert torch.equal(again.runner.kv_caches[0], caches[0])
