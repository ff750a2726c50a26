"""Fixtures shared by the integration tests that compare a cluster's output with transformers'."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.reference import hf_greedy


@pytest.fixture(scope="session")
def path(checkpoint) -> str:
    """The GQA parity checkpoint (a module that needs another one defines its own `path`)."""
    return str(checkpoint("llama-gqa"))


@pytest.fixture(scope="module")
def builtin_llm(builtin_path):
    """The offline engine on the built-in model (what the OpenAI-client tests compare with)."""
    from pdcluster import LLM

    return LLM(str(builtin_path), max_model_len=512, num_blocks=128)


@pytest.fixture(scope="module")
def openai_cluster(builtin_path):
    """A disaggregated cluster of the built-in model with its OpenAI HTTP API (one per module)."""
    from tests.integration.openai_helpers import serve_openai

    with serve_openai(builtin_path) as c:
        yield c


@pytest.fixture(scope="session")
def reference(path: str) -> Callable[[list[int], int], list[int]]:
    """`reference(ids, n)`: transformers' greedy tokens after `ids` on `path`."""
    return hf_greedy(path)
