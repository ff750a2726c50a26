"""Shared fixtures: tiny checkpoints and a private cache directory for the built-in model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests never touch the user's ~/.cache/pdcluster (unless PDCLUSTER_CACHE is set already)."""
    if "PDCLUSTER_CACHE" not in os.environ:
        os.environ["PDCLUSTER_CACHE"] = str(tmp_path_factory.mktemp("pdcluster-cache"))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """`checkpoint(shape, **overrides)` -> path of a tiny random checkpoint (cached per session)."""
    made: dict[tuple, Path] = {}

    def get(shape: str = "llama-gqa", **overrides) -> Path:
        key = (shape, tuple(sorted(overrides.items(), key=str)))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(shape), shape, **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def builtin_path() -> Path:
    from engine.builtin_model import resolve_model_path

    return resolve_model_path("builtin:tiny-llama")
