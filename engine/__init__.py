"""The engine both kinds of worker run: checkpoint loading, model runner over a paged KV cache,
block manager, scheduler and sampler.

The names below are loaded on first use: `from engine.config import ...` or
`from engine.request_checks import ...` (the router) does not import torch or the model runner.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "SUPPORTED_ARCHITECTURES": "engine.config",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "BlockManager": "engine.block_manager",
    "resolve_model_path": "engine.builtin_model",
    "write_builtin_model": "engine.builtin_model",
    "IncrementalDetokenizer": "engine.detokenizer",
    "Engine": "engine.engine",
    "SamplingParams": "engine.sampling_params",
    "Sequence": "engine.sequence",
    "TokenLogprobs": "engine.sequence",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
