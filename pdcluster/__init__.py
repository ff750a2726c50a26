"""pdcluster: a Prefill-Decode disaggregated LLM serving cluster.

Offline use: `from pdcluster import LLM, SamplingParams`.

The offline API is loaded on first use, so that importing a submodule (`pdcluster.client` for
`pdcluster status`, `pdcluster.cluster_config` in the planner) does not import torch (1.1 s here,
and 100k+ objects on the heap of a process that does not need them).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("LLM", "RequestOutput"):
        from pdcluster import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pdcluster' has no attribute {name!r}")
