"""pdcluster: a Prefill-Decode disaggregated LLM serving cluster.

Offline use: `from pdcluster import LLM, SamplingParams`.
"""

from engine.sampling_params import SamplingParams
from pdcluster.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
