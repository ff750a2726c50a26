"""Tensor parallelism inside one engine (engine/tp_*.py): two CPU processes in a gloo group, the
model split Megatron-style. Greedy output equals transformers' generate() token for token on GQA
8:4, MQA (the KV head replicated), Qwen2 with biases and two mixture-of-experts models, through chunked prefill and preemption;
forked choices (n) copy their blocks on every rank; a rank that dies fails the next step with a
clear error (no hang); sizes the model cannot be split by are refused before any process starts."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.sampling_params import SamplingParams
from engine.tp_group import TPError
from pdcluster.llm import LLM
from pdcluster.local_cluster import LocalCluster
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([15, 31, 47, 60, 1])]
N = 12
SHAPES = {"gqa-8-4": ("llama-gqa", dict(num_attention_heads=8, num_key_value_heads=4)),
          "mqa": ("llama-mqa-tied", {}), "qwen2-bias": ("qwen2-bias", {}),
          # every expert sharded across the ranks; a dense first layer beside routed ones
          "mixtral": ("mixtral", {}), "qwen3-moe-dense-first": ("qwen3-moe-dense-first", {}),
          # latent attention: query heads split, the latent whole on every rank; shared experts split
          "deepseek-v3": ("deepseek-v3", {}), "deepseek-v2": ("deepseek-v2", {}),
          # sinks split with the heads, sliding windows, biased experts' gate/up pairs split together
          "gpt-oss": ("gpt-oss", {})}


def _llm(path: str, tp: int = 2, **kw) -> LLM:
    # 8 blocks of 16 for prompts of up to 72 tokens, three of them one token short of a block: prompts
    # are chunked (32-token steps) and sequences preempted and recomputed
    opts = dict(dtype="float32", max_model_len=128, num_blocks=8, max_num_batched_tokens=32, max_num_seqs=4)
    return LLM(path, tensor_parallel_size=tp, **{**opts, **kw})


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_equals_transformers_with_two_ranks(checkpoint, shape):
    """The tokens equal transformers'; their log-probabilities equal one rank's (which
    tests/unit/test_parity.py checks against transformers): greedy tokens of these decisive models
    would survive a bias counted twice, the log-probabilities do not."""
    name, overrides = SHAPES[shape]
    path = str(checkpoint(name, **overrides))
    ref = hf_greedy(path)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=1)
    one = _llm(path, tp=1, num_blocks=64)
    try:
        want = one.generate(PROMPTS, params)
    finally:
        one.close()
    llm = _llm(path)
    try:
        outs = llm.generate(PROMPTS, params)
        assert llm.engine.scheduler.num_preemptions > 0  # the recompute path ran too
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == [ref(p, N) for p in PROMPTS]
    for got, exp in zip(outs, want):
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in exp.logprobs]), atol=1e-4, rtol=1e-4)


def test_forked_choices_match_one_rank(checkpoint):
    path = str(checkpoint("llama-gqa", num_attention_heads=8, num_key_value_heads=4))
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=4, n=3)
    want = _llm(path, tp=1, num_blocks=64).generate(PROMPTS[1:3], params)
    llm = _llm(path, num_blocks=64)
    try:
        got = llm.generate(PROMPTS[1:3], params)
    finally:
        llm.close()
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]


def test_a_rank_that_dies_fails_the_next_step_clearly(checkpoint):
    path = str(checkpoint("llama-gqa"))
    llm = _llm(path, num_blocks=64)
    try:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
        child = llm.engine._ranks.processes[0]
        child.kill()
        child.join(5)
        t0 = time.monotonic()
        with pytest.raises(TPError, match="tensor-parallel"):
            llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4))
        assert time.monotonic() - t0 < 30
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # the failed request's blocks are free
    finally:
        llm.close()


def test_a_failure_inside_a_step_breaks_the_engine_for_good(checkpoint, monkeypatch):
    """The other ranks are inside the step's collectives: rank 0 must not step again with them."""
    path = str(checkpoint("llama-gqa"))
    llm = _llm(path, num_blocks=64)
    try:
        # fails before the layer's all-reduce, which the other rank then waits in
        monkeypatch.setattr(llm.engine.runner.model.layers[0].mlp, "forward", lambda x: 1 / 0)
        with pytest.raises(TPError, match="out of step"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
        monkeypatch.undo()
        with pytest.raises(TPError, match="out of step"):  # refused at once, nothing sent
            llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2))
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.close()


def test_sizes_the_model_cannot_be_split_by_are_refused(checkpoint):
    path = str(checkpoint("llama-gqa"))  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="divide the model's 4 attention heads"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="decode_tensor_parallel_size applies to mode='disaggregated'"):
        LLM(path, decode_tensor_parallel_size=2)


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 2)])
def test_offline_disaggregated_between_degrees_equals_transformers(checkpoint, p_tp, d_tp):
    path = str(checkpoint("llama-mqa-tied"))  # one KV head: replicated on both ranks, sent once
    ref = hf_greedy(path)
    llm = _llm(path, tp=p_tp, decode_tensor_parallel_size=d_tp, mode="disaggregated", num_blocks=64)
    try:
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0))]
    finally:
        llm.close()
    assert got == [ref(p, N) for p in PROMPTS]


# ------------------------------------------------------------------ a cluster of tensor-parallel workers
def _cluster(path: str, backend: str, p_tp: int, d_tp: int, direct: tuple[bool, bool] = (True, True),
             overlap: int = 0) -> LocalCluster:
    base = EngineConfig(model=path, dtype="float32", num_blocks=64, max_model_len=128, num_threads=1)
    kv = {"kv_backend": backend}
    return LocalCluster(base, 1, 1, prefill={"kv_timeout_s": 10.0, "direct_kv": direct[0], **kv},
                        decode={"direct_kv": direct[1], **kv},
                        router={"request_timeout_s": 60, "reserve_overlap_max_tokens": overlap},
                        prefill_engine=dataclasses.replace(base, tensor_parallel_size=p_tp),
                        decode_engine=dataclasses.replace(base, tensor_parallel_size=d_tp))


def _serve(c: LocalCluster, prompts: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Greedy outputs, then the KV bytes prefill rank 0 sent and those the prompts hold (every head)."""
    with c.client() as client:
        got = [client.complete(p, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)).token_ids
               for p in prompts]
    assert c.wait_blocks_free()
    prefill = c.prefill_workers[0]
    total = sum(-(-len(p) // prefill.engine.block_size) for p in prompts) * prefill.engine.kv_bytes_per_block
    return got, sum(prefill.prefill.sender.bytes_sent.values()), total


def _all_ranks_sent(c: LocalCluster) -> int:
    """The KV bytes every rank of the prefill worker sent, as its Stats reports them."""
    return sum(c.prefill_workers[0].prefill.bytes_sent().values())


@pytest.mark.parametrize("backend", ["shm", "tcp", "grpc"])
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 2)])
def test_cluster_between_tensor_parallel_degrees_equals_transformers(checkpoint, backend, p_tp, d_tp):
    """The direct path: each decode rank gets its KV heads from the prefill rank holding them."""
    path = str(checkpoint("llama-gqa", num_attention_heads=8, num_key_value_heads=4))
    ref = hf_greedy(path)
    with _cluster(path, backend, p_tp, d_tp) as c:
        assert [len(w.engine_ranks()) for w in c.workers] == [p_tp, d_tp]  # the workers run split as asked
        assert len(c.decode_workers[0].decode.rank_endpoints) == (d_tp if d_tp > 1 else 0)  # a receiver per rank
        got, sent, total = _serve(c, PROMPTS[:4])
        assert _all_ranks_sent(c) == total  # every KV head sent once, by the rank holding it
    assert got == [ref(p, N) for p in PROMPTS[:4]]
    assert sent == total // p_tp  # prefill rank 0 sent its own heads only: 2 of the 4 KV heads with 2 ranks


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_a_ticket_that_follows_reaches_every_rank(checkpoint, monkeypatch, p_tp, d_tp):
    """router.reserve_overlap_max_tokens on: a tensor-parallel prefill worker parks the prompt until
    its ticket comes (its ranks send their own heads as computed); a prefill worker of one rank holds
    the K/V it computed before the ticket and sends each decode rank its heads from what it held."""
    from prefill_worker import prefill_engine

    held, send_held = [], prefill_engine.send_held
    monkeypatch.setattr(prefill_engine, "send_held", lambda *a: (held.append(a[-1]), send_held(*a)))
    path = str(checkpoint("llama-gqa", num_attention_heads=8, num_key_value_heads=4))
    ref = hf_greedy(path)
    with _cluster(path, "shm", p_tp, d_tp, overlap=128) as c:
        got, sent, total = _serve(c, PROMPTS[:3])
        assert _all_ranks_sent(c) == total
    assert got == [ref(p, N) for p in PROMPTS[:3]] and sent == total // p_tp
    assert held == ([] if p_tp > 1 else [True] * len(held)) and (p_tp > 1 or held)  # held, sent in parts


def test_a_transfer_is_refused_until_every_decode_rank_has_its_heads(checkpoint, monkeypatch):
    """P1 -> D2 whose prefill worker leaves out decode rank 1's part: decode rank 0 asks its rank,
    refuses the commit naming the missing heads, every block comes back; with the parts restored the
    same cluster serves transformers' tokens."""
    from kv_transfer import parts

    path = str(checkpoint("llama-gqa", num_attention_heads=8, num_key_value_heads=4))
    ref = hf_greedy(path)
    full_plan = parts.plan
    monkeypatch.setattr(parts, "plan", lambda k, a, b: [p for p in full_plan(k, a, b) if p.dst != 1])
    with _cluster(path, "tcp", 1, 2) as c:
        c.router.orchestrator.max_retries = 0
        with c.client() as client, pytest.raises(Exception, match=r"rank 1: KV heads \[2, 3\]"):
            client.complete(PROMPTS[1], SamplingParams(max_tokens=N, temperature=0.0))
        assert c.wait_blocks_free()
        monkeypatch.setattr(parts, "plan", full_plan)
        got, _, _ = _serve(c, PROMPTS[1:2])
    assert got == [ref(PROMPTS[1], N)]


def test_replicated_kv_heads_are_sent_by_the_replicas_in_turn(checkpoint):
    """MQA P2 -> D2: both prefill ranks hold the one KV head; each decode rank gets it from one of them."""
    path = str(checkpoint("llama-mqa-tied"))
    ref = hf_greedy(path)
    with _cluster(path, "tcp", 2, 2) as c:
        got, sent, total = _serve(c, PROMPTS[:3])
        both = _all_ranks_sent(c)
    assert got == [ref(p, N) for p in PROMPTS[:3]]
    # the head goes to each of the two decode ranks: rank 0 sent it once, so rank 1 sent the other
    assert (sent, both) == (total, 2 * total)


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 2)])
def test_a_latent_is_sent_once_to_each_decode_rank(checkpoint, p_tp, d_tp):
    """DeepSeek's latent, the same for every head, is whole on every rank: each decode rank receives
    it once, from one prefill rank (P2 -> D1: one copy, not one per prefill rank)."""
    path = str(checkpoint("deepseek-v3"))
    ref = hf_greedy(path)
    with _cluster(path, "tcp", p_tp, d_tp) as c:
        got, _, total = _serve(c, PROMPTS[:3])
        both = _all_ranks_sent(c)
    assert got == [ref(p, N) for p in PROMPTS[:3]]
    spec = ModelConfig.from_pretrained(path).kv_spec
    assert total == sum(-(-len(p) // 16) for p in PROMPTS[:3]) * 16 * spec.bytes_per_token(torch.float32)
    assert both == d_tp * total


@pytest.mark.parametrize("direct", [(False, False), (True, False), (False, True)], ids=["both", "decode", "prefill"])
def test_the_fallback_path_through_rank_0_still_serves(checkpoint, direct):
    """direct_kv=False on either side: a prefill worker without per-rank senders gathers every head on
    rank 0; a decode worker without per-rank receivers takes every head (whole, or in parts) at rank 0
    and hands each rank its own."""
    path = str(checkpoint("llama-gqa", num_attention_heads=8, num_key_value_heads=4))
    ref = hf_greedy(path)
    with _cluster(path, "grpc", 2, 2, direct=direct) as c:
        assert len(c.decode_workers[0].decode.rank_endpoints) == (2 if direct[1] else 0)
        got, sent, total = _serve(c, PROMPTS[:3])
    assert got == [ref(p, N) for p in PROMPTS[:3]]
    assert sent == (total // 2 if direct[0] else total)


def test_an_mxfp4_gpt_oss_checkpoint_splits_after_dequantizing(checkpoint, tmp_path):
    """gpt-oss as published (experts in mxfp4): each rank dequantizes, then takes its slice of every
    expert (gate/up pairs together); two ranks generate what one does."""
    from tests.quantized_checkpoints import write_mxfp4

    path, _ = write_mxfp4(checkpoint("gpt-oss", intermediate_size=64), tmp_path / "mxfp4")
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    one = _llm(str(path), tp=1, num_blocks=64)
    try:
        want = [o.token_ids for o in one.generate(PROMPTS, params)]
    finally:
        one.close()
    llm = _llm(str(path), num_blocks=64)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    finally:
        llm.close()
