"""A disaggregated cluster of the built-in model with its OpenAI HTTP API, for the tests that drive
it with OpenAI clients (the `openai` package, LangChain)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from engine.config import EngineConfig
from pdcluster.local_cluster import LocalCluster

MODEL = "builtin:tiny-llama"


def builtin_engine(path: str | Path) -> EngineConfig:
    return EngineConfig(model=str(path), num_blocks=256, max_model_len=512, num_threads=1)


@contextmanager
def serve_openai(path: str | Path, num_decode: int = 1) -> Iterator[LocalCluster]:
    """One prefill worker, `num_decode` decode workers, the router and its HTTP API."""
    with LocalCluster(builtin_engine(path), 1, num_decode, router={"model": MODEL, "request_timeout_s": 60},
                      http={}) as c:
        yield c


def openai_client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(cluster), api_key="unused", max_retries=0, timeout=60)


def base_url(cluster: LocalCluster) -> str:
    return f"http://{cluster.http.address}/v1"
