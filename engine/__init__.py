"""The engine both kinds of worker run: checkpoint loading, model runner over a paged KV cache,
block manager, scheduler and sampler."""

from engine.block_manager import BlockManager
from engine.builtin_model import resolve_model_path, write_builtin_model
from engine.config import SUPPORTED_ARCHITECTURES, EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, TokenLogprobs

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "BlockManager",
    "Engine",
    "EngineConfig",
    "IncrementalDetokenizer",
    "ModelConfig",
    "SamplingParams",
    "Sequence",
    "TokenLogprobs",
    "resolve_model_path",
    "write_builtin_model",
]
