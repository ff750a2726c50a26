"""Load generator for any OpenAI-compatible endpoint (`pdcluster bench serve`).

workload.py (traces, synthetic lengths) -> prompts.py (text of a token length, shared prefixes) ->
arrivals.py (open-loop offsets) -> runner.py + client.py (streamed /v1/completions, client-side timing)
-> metrics.py (percentiles, SLO attainment, goodput) -> report.py (JSON, markdown, PNG). cli.py ties them.
Multi-turn chat: conversations.py (turns from flags or a Mooncake trace, the history) run by
conversation_run.py (each conversation a closed loop, started open-loop).
"""

from loadgen.arrivals import ArrivalConfig, arrival_offsets
from loadgen.client import EndpointConfig, RequestRecord
from loadgen.metrics import SLO, Summary, summarize
from loadgen.runner import RunResult, run
from loadgen.scaling import Scaling
from loadgen.workload import Request, Workload, WorkloadConfig, load_workload

__all__ = ["SLO", "ArrivalConfig", "EndpointConfig", "Request", "RequestRecord", "RunResult", "Scaling",
           "Summary", "Workload", "WorkloadConfig", "arrival_offsets", "load_workload", "run", "summarize"]
