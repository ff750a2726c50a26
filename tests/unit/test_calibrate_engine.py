"""What `pdcluster plan calibrate` reads from the engine: Engine.step_with_rows runs a step as
Engine.step does and gives each scheduled sequence's (tokens computed before, tokens computed now)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def test_step_with_rows_gives_the_shape_of_each_step_of_chunked_prefills_then_decodes(checkpoint):
    cfg = EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=64, max_model_len=256,
                       max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False)
    engine = Engine(cfg, "colocated")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    a = engine.add_request("a", list(range(3, 43)), params)  # 40 tokens: chunks of 32 + 8
    b = engine.add_request("b", list(range(3, 13)), params)  # 10 tokens
    steps = []
    while engine.has_work():
        steps.append(engine.step_with_rows())
    assert [rows for _, rows in steps] == [[(0, 32)], [(32, 8), (0, 10)], [(40, 1), (10, 1)], [(41, 1), (11, 1)]]
    assert [[s.request_id for s in got] for got, _ in steps] == [[], ["a", "b"], ["a", "b"], ["a", "b"]]
    assert a.num_output_tokens == b.num_output_tokens == 3
    assert engine.step_with_rows() == ([], []) and engine.last_step is None
