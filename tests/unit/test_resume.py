"""A request resumed after a worker failure (prompt + the tokens already sent, `output_offset`) goes on
exactly as the first attempt would have: greedy and seeded sampling alike (the router's retries rely
on it)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

N = 12


def _generate(engine: Engine, rid: str, ids: list[int], params: SamplingParams, offset: int = 0) -> list[int]:
    seq = engine.add_request(rid, ids, params, output_offset=offset)
    for _ in range(10 * N):
        engine.step()
        if seq.finish_reason is not None:
            return seq.output_token_ids
    raise AssertionError("did not finish")


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=1.0, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True),
])
@pytest.mark.parametrize("cut", [1, 5, N - 1])
def test_a_resumed_request_continues_the_same_output(checkpoint, params, cut):
    engine = Engine(EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=64, max_model_len=256, num_threads=1))
    prompt = [5, 9, 17, 33, 60, 61, 62]
    full = _generate(engine, "a", prompt, params)
    assert len(full) == N
    resumed = _generate(engine, "b", prompt + full[:cut], dataclasses.replace(params, max_tokens=N - cut), cut)
    assert resumed == full[cut:]


def test_a_negative_offset_is_refused(checkpoint):
    engine = Engine(EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=64, max_model_len=256, num_threads=1))
    with pytest.raises(ValueError, match="output_offset"):
        engine.add_request("x", [5, 6], SamplingParams(), output_offset=-1)
