"""Quantized KV pages through the cluster: a disaggregated pair on each data plane serves the same
tokens as one engine with the same pages (the prefill worker's quantized bytes and scales are what
the decode worker attends to), the transfer moves one byte a value plus a scale a row, and a pair
whose page formats differ is refused at the handshake, naming the difference."""

from __future__ import annotations

import grpc
import pytest
import torch

from decode_worker.decode_engine import DecodeEngine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from pdcluster.llm import LLM
from pdcluster.local_cluster import LocalCluster
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.integration.kv_helpers import grpc_server

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-llama"  # 6 layers, 4 KV heads of 48
N = 12
PROMPTS = [[1] + [(29 * i + 13 * j) % 8000 + 4 for j in range(n)] for i, n in enumerate([7, 30, 52])]


def _engine(kv_cache_dtype: str) -> EngineConfig:
    return EngineConfig(model=MODEL, num_blocks=64, block_size=16, max_model_len=256, num_threads=1,
                        max_num_batched_tokens=32, max_num_seqs=8, dtype="float32", kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("backend", ["grpc", "shm", "tcp", "torch_distributed"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_disaggregated_pair_serves_what_one_engine_with_the_same_pages_serves(kv_cache_dtype, backend):
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(MODEL, dtype="float32", kv_cache_dtype=kv_cache_dtype, num_blocks=64,
                                     max_model_len=256).generate(PROMPTS, params)]
    kv = {"kv_backend": backend}
    with LocalCluster(_engine(kv_cache_dtype), 1, 1, prefill={"kv_timeout_s": 10.0, **kv}, decode=kv,
                      router={"request_timeout_s": 60}) as c, c.client() as client:
        got = [client.complete(p, params).token_ids for p in PROMPTS]
        sent = sum(c.prefill_workers[0].prefill.bytes_sent().values())
        decode_cache = c.decode_workers[0].engine.runner.kv_caches[0]
    assert got == want
    assert decode_cache.dtype == torch.uint8 and decode_cache.shape[-1] == 48 + 4
    # whole blocks of 16 token slots, each slot: K and V x 6 layers x 4 heads x (48 bytes + a 4-byte scale)
    blocks = sum(-(-len(p) // 16) for p in PROMPTS)
    assert sent == blocks * 16 * 2 * 6 * 4 * (48 + 4)
    assert sent / (blocks * 16 * 2 * 6 * 4 * 48 * 4) < 0.28  # against the float32 cache's bytes


def test_tensor_parallel_engines_keep_their_heads_pages_and_move_them_between_degrees():
    """P TP 2 -> D TP 1 and P TP 1 -> D TP 2: each rank quantizes its own heads' rows; the pages
    travel between degrees as bytes and serve what TP 1 on both sides serves."""
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_dtype="int8", num_blocks=64, max_model_len=256, mode="disaggregated")
    want = [o.token_ids for o in LLM(MODEL, **kw).generate(PROMPTS, params)]
    for p_tp, d_tp in ((2, 1), (1, 2)):
        llm = LLM(MODEL, tensor_parallel_size=p_tp, decode_tensor_parallel_size=d_tp, **kw)
        try:
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want, (p_tp, d_tp)
        finally:
            llm.close()


def test_a_pair_whose_pages_differ_is_refused_at_the_handshake():
    plain = Engine(_engine("auto"), "prefill")
    try:
        with grpc_server() as (srv, endpoint):
            decode = DecodeEngine(Engine(_engine("int8"), "decode"), backend="grpc", server=srv, endpoint=endpoint)
            srv.start()
            try:
                with grpc.insecure_channel(endpoint) as ch:
                    stub = kv_transfer_pb2_grpc.KVReceiverStub(ch)
                    response = stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=plain.compat_hash),
                                              timeout=5)
                    assert not response.ok
                    assert "kv heads:4x48x6 vs heads:4x48x6,int8" in response.reason, response.reason
                    same = stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=decode.compat_hash), timeout=5)
                    assert same.ok
            finally:
                decode.close()
    finally:
        plain.close()
