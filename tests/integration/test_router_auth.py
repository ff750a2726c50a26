"""API keys on the router's gRPC API: Generate and Abort without a valid key are UNAUTHENTICATED.

Real router and worker servers in this process (no Ray)."""

from __future__ import annotations

import grpc
import pytest

from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.local_cluster import LocalCluster
from proto import generate_pb2 as gen
from proto import generate_pb2_grpc as gen_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(checkpoint):
    path = str(checkpoint("llama-gqa"))
    cfg = EngineConfig(model=path, num_blocks=64, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, router={"request_timeout_s": 30, "api_keys": ["k1", "k2"]}) as c:
        yield c.router


@pytest.mark.parametrize("metadata", [None, [("x-api-key", "nope")], [("authorization", "Bearer nope")]])
def test_generate_and_abort_without_a_valid_key_are_refused(router, metadata):
    with grpc.insecure_channel(router.address) as ch:
        stub = gen_grpc.PDClusterStub(ch)
        req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[5, 6, 7]), sampling=gen.SamplingParams(max_tokens=2))
        for call in (lambda: list(stub.Generate(req, metadata=metadata, timeout=10)),
                     lambda: stub.Abort(gen.AbortRequest(request_id="x"), metadata=metadata, timeout=10)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in info.value.details()


def test_a_valid_key_in_either_header_is_served(router):
    with Client(router.address, api_key="k2") as client:
        out = client.complete([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(out.token_ids) == 3
    with grpc.insecure_channel(router.address) as ch:
        resp = gen_grpc.PDClusterStub(ch).Abort(gen.AbortRequest(request_id="none"),
                                                metadata=[("authorization", "Bearer k1")], timeout=10)
        assert resp.found is False
