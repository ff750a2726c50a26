"""Penalties, logit_bias and min_tokens through every path: transformers' generate() where it has the
feature (repetition_penalty, sequence_bias), the offline LLM where it does not (presence and
frequency penalties), and the disaggregated cluster (the first token sampled on the prefill
worker, the rest on the decode worker) equal to both, greedy float32, token for token."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from pdcluster.llm import LLM
from pdcluster.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
N = 12
PROMPTS = [[(s * 37 + 11 * j) % 200 + 3 for j in range(n)] for s, n in ((1, 9), (2, 23), (3, 40))]


def _greedy(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, **kw)


CASES = {
    "repetition": _greedy(repetition_penalty=1.6),
    "frequency+presence": _greedy(frequency_penalty=1.5, presence_penalty=0.75),
    "negative presence": _greedy(presence_penalty=-2.0),
    "logit_bias": _greedy(logit_bias={5: 8.0, 17: -100.0}),
    "all": _greedy(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={9: 3.0}),
}


@pytest.fixture(scope="module")
def offline(path):
    return {mode: LLM(path, dtype="float32", mode=mode, max_model_len=256, num_blocks=64)
            for mode in ("colocated", "disaggregated")}


def _offline(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)]


def test_repetition_penalty_and_logit_bias_equal_transformers(offline, reference):
    plain = [reference(p, N) for p in PROMPTS]
    for name, kw in (("repetition", {"repetition_penalty": 1.6}),
                     ("logit_bias", {"sequence_bias": {(5,): 8.0, (17,): -100.0}})):
        want = [reference(p, N, **kw) for p in PROMPTS]
        assert want != plain, f"{name} changes nothing on this model: the test would prove nothing"
        for mode, llm in offline.items():
            assert _offline(llm, CASES[name]) == want, (name, mode)


def test_colocated_and_disaggregated_engines_agree_on_every_adjustment(offline):
    plain = _offline(offline["colocated"], _greedy())
    for name, params in CASES.items():
        col = _offline(offline["colocated"], params)
        assert col != plain, f"{name} changes nothing on this model"
        assert _offline(offline["disaggregated"], params) == col, name


def test_min_tokens_holds_back_a_stop_token_until_reached(offline):
    llm = offline["colocated"]
    first = _offline(llm, _greedy())[0][0]
    stopped = llm.generate([PROMPTS[0]], _greedy(stop_token_ids=[first]), use_tqdm=False)[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate([PROMPTS[0]], _greedy(stop_token_ids=[first], min_tokens=5), use_tqdm=False)[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]


@pytest.mark.parametrize("backend", ["grpc", "shm"])
def test_the_cluster_equals_the_offline_engine(path, offline, backend):
    cfg = EngineConfig(model=path, num_blocks=128, block_size=16, max_model_len=256, num_threads=1,
                       max_num_batched_tokens=64, max_num_seqs=8, dtype="float32")
    kv = {"kv_backend": backend}
    with LocalCluster(cfg, 1, 1, prefill={"kv_timeout_s": 10.0, **kv}, decode=kv,
                      router={"request_timeout_s": 60}) as c, c.client() as client:
        firsts = sorted({out[0] for out in _offline(offline["colocated"], _greedy())})
        held = _greedy(min_tokens=4, stop_token_ids=firsts)  # each prompt's first greedy token would stop it
        assert all(len(x) == 1 for x in _offline(offline["colocated"], _greedy(stop_token_ids=firsts)))
        for name, params in {**CASES, "min_tokens": held}.items():
            want = _offline(offline["colocated"], params)
            assert name != "min_tokens" or all(len(x) >= 4 for x in want)
            got = [client.complete(p, params).token_ids for p in PROMPTS]
            assert got == want, name
        assert c.wait_blocks_free()


def test_a_request_resumed_on_another_decode_worker_is_penalised_as_if_it_had_not_failed(path, offline):
    """The decode worker serving a penalised request is stopped mid-stream: the router resumes it on
    the other one from the tokens streamed, which count as completion there (frequency, presence,
    repetition and min_tokens see them), so the output equals the uninterrupted one."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.8, presence_penalty=0.4, logit_bias={9: 2.0})
    want = _offline(offline["colocated"], params)[2]
    cfg = EngineConfig(model=path, num_blocks=128, block_size=16, max_model_len=256, num_threads=1, dtype="float32")
    with LocalCluster(cfg, 1, 2, router={"request_timeout_s": 60, "max_retries": 2}) as c, c.client() as client:
        got, stopped = [], False
        for chunk in client.stream(list(PROMPTS[2]), params):
            got += chunk.token_ids
            if len(got) >= 8 and not stopped:
                next(w for w in c.decode_workers if w.stats().running).stop()
                stopped = True
        assert stopped and got == want
        assert c.router.metrics.retries._value.get() >= 1
