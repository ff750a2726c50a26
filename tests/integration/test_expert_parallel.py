"""Expert parallelism with real ranks (two CPU processes in a gloo group): each rank holds half the
routed experts whole, attention and the dense/shared MLPs split as with tensor parallelism, one
all-reduce per layer combining. Greedy float32 output equals transformers' generate() token for
token for the built-in Qwen3-MoE (tiny-moe) and a DeepSeek-V3 shape (latent attention, a shared
expert, a dense first layer), offline and through a disaggregated cluster whose decode pool says
`expert_parallel: true` in its cluster.yaml mapping."""

from __future__ import annotations

import pytest

from engine.builtin_model import resolve_model_path
from engine.config import EngineConfig
from engine.models.moe import SparseMoE
from engine.sampling_params import SamplingParams
from pdcluster.cluster_config import ClusterConfig
from pdcluster.llm import LLM
from pdcluster.local_cluster import LocalCluster
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow

N = 12
PROMPTS = [[1] + [(37 * i + 11 * j) % 500 + 4 for j in range(n)] for i, n in enumerate([5, 23, 40, 61])]


def _held(model) -> list[int]:
    """How many routed experts each MoE layer of this rank's model holds."""
    return [layer.mlp.experts.gate_up_proj.shape[0] for layer in model.layers if isinstance(layer.mlp, SparseMoE)]


@pytest.mark.parametrize("model", ["builtin:tiny-moe", "deepseek-v3"])
def test_greedy_equals_transformers_with_two_expert_parallel_ranks(checkpoint, model):
    path = str(resolve_model_path(model) if model.startswith("builtin:") else checkpoint(model))
    ref = hf_greedy(path, pad_token_id=3)
    # 8 blocks of 16 for prompts of up to 62 tokens: chunked prefill (32-token steps) and preemption
    llm = LLM(path, tensor_parallel_size=2, expert_parallel=True, dtype="float32", max_model_len=128, num_blocks=8,
              max_num_batched_tokens=32, max_num_seqs=4)
    try:
        layout = llm.engine.runner.tp.layout
        assert layout.expert_parallel and layout.experts == range(0, 4)  # 8 experts: rank 0 holds 0-3
        assert set(_held(llm.engine.model)) == {4}
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == [ref(p, N) for p in PROMPTS]


def test_gpt_oss_with_two_expert_parallel_ranks_equals_transformers(checkpoint):
    """gpt-oss keeps its experts stacked: each rank reads its rows of every expert tensor, biases too."""
    path = str(checkpoint("gpt-oss"))
    ref = hf_greedy(path, pad_token_id=3)
    llm = LLM(path, tensor_parallel_size=2, expert_parallel=True, dtype="float32", max_model_len=128, num_blocks=8,
              max_num_batched_tokens=32, max_num_seqs=4)
    try:
        assert llm.engine.runner.tp.layout.experts == range(0, 2)  # 4 experts: rank 0 holds 0-1
        assert {layer.mlp.experts.gate_up_proj.shape[0] for layer in llm.engine.model.layers} == {2}
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == [ref(p, N) for p in PROMPTS]


def test_a_cluster_whose_decode_pool_is_expert_parallel_serves_transformers_tokens():
    """cluster.yaml's pool keys -> the engines' configs -> a disaggregated cluster (router, workers,
    KV transfer from a one-rank prefill worker to each rank of the expert-parallel decode worker)."""
    model = "builtin:tiny-moe"
    ref = hf_greedy(str(resolve_model_path(model)), pad_token_id=3)
    cfg = ClusterConfig.from_dict({
        "model": {"path": model, "dtype": "float32", "max_model_len": 256},
        "kv_cache": {"num_blocks": 64}, "engine": {"num_threads": 1},
        "pools": [{"name": "prefill", "role": "prefill"},
                  {"name": "decode", "role": "decode", "tensor_parallel_size": 2, "expert_parallel": True}]})
    prefill, decode = (EngineConfig(**cfg.engine_kwargs(pool)) for pool in cfg.pools)
    assert decode.expert_parallel and decode.tensor_parallel_size == 2 and not prefill.expert_parallel
    with LocalCluster(prefill, 1, 1, prefill={"kv_timeout_s": 10.0}, router={"request_timeout_s": 60},
                      prefill_engine=prefill, decode_engine=decode) as c:
        worker = c.decode_workers[0]
        assert len(worker.engine_ranks()) == 2
        assert set(_held(worker.decode.engine.model)) == {4}  # its rank 0: experts 0-3 of 8
        with c.client() as client:
            params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
            got = [client.complete(p, params).token_ids for p in PROMPTS]
        assert c.wait_blocks_free()
    assert got == [ref(p, N) for p in PROMPTS]
