"""The checks a request passes before any engine sees it, torch-free: the router runs them without
loading a model runner, and every engine runs the same ones."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.sampling_params import SamplingParams


def resolve_max_model_len(model_cfg: ModelConfig, requested: int | None) -> int:
    """The longest sequence (prompt + output) served: `requested`, or the model's limit capped at 4096."""
    limit = model_cfg.max_position_embeddings
    if requested is None:
        return min(limit, 4096)
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit {limit}")
    return requested


MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias


def validate_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the problem with sampling parameters that depend on the model."""
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(params.logit_bias)}")
    bad = next((t for t in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")


def validate_request(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError naming the problem with a request (shared by engines and the router)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    validate_sampling(params, vocab_size)
    if len(token_ids) == 0:
        raise ValueError("prompt is empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens; max_model_len is {max_model_len} "
            "(the prompt must leave room for at least one generated token)"
        )
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")
