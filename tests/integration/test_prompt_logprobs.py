"""Prompt logprobs through the cluster's gRPC API, on the first message, equal to the offline engine:
prefilled on a prefill worker, on a decode worker (conditional disaggregation), and colocated."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from pdcluster.llm import LLM
from pdcluster.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
PROMPT = [(11 * j + 5) % 200 + 4 for j in range(40)]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)


@pytest.mark.parametrize("mode, router", [("disaggregated", {}),
                                          ("disaggregated", {"local_prefill_uncached_tokens": 4096}),
                                          ("colocated", {})])
def test_the_first_message_carries_the_prompt_logprobs(path, mode, router):
    want = LLM(path, dtype="float32", max_model_len=256, num_blocks=64).generate([PROMPT], PARAMS, use_tqdm=False)[0]
    cfg = EngineConfig(model=path, num_blocks=64, max_model_len=256, num_threads=1, dtype="float32")
    with LocalCluster(cfg, mode=mode, router={"request_timeout_s": 60, **router}) as c, c.client() as client:
        msgs = list(client.stream(PROMPT, PARAMS))
        if router:
            assert c.decode_workers[0].stats().local_prefills == 1
    got = msgs[0].prompt_logprobs
    assert [x.token_id for x in got] == PROMPT[1:] and all(not m.prompt_logprobs for m in msgs[1:])
    assert [x.logprob for x in got] == pytest.approx([x.logprob for x in want.prompt_logprobs], abs=1e-4)
    assert [[t.token_id for t in x.top] for x in got] == [[t for t, _ in x.top] for x in want.prompt_logprobs]
    assert [x.rank for x in got] == [x.rank for x in want.prompt_logprobs]
