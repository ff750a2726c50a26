"""The .proto definitions and their checked-in generated code."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from kv_transfer.checksum import checksum
from tests.scripts import load_script

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
REGEN_HINT = "run python scripts/gen_proto.py"


gen_proto = load_script("gen_proto")


def _generated_names(directory: Path) -> set[str]:
    return {p.name for suffix in gen_proto.GENERATED_SUFFIXES for p in directory.glob("*" + suffix)}


# ---- (a) freshness ----


def test_every_proto_has_generated_code():
    protos = gen_proto.proto_files(REPO_ROOT)
    assert {Path(p).name for p in protos} >= {"generate.proto", "worker.proto", "kv_transfer.proto"}
    for proto in protos:
        for rel in gen_proto.expected_outputs(proto):
            assert (REPO_ROOT / rel).is_file(), f"{rel} missing for {proto}: {REGEN_HINT}"


def test_generated_code_is_fresh(tmp_path):
    gen_proto.generate(tmp_path)
    fresh_dir = tmp_path / "proto"
    fresh = _generated_names(fresh_dir)
    checked_in = _generated_names(PROTO_DIR)
    assert fresh, "gen_proto produced nothing"
    missing = sorted(fresh - checked_in)
    assert not missing, f"generated files not checked in: {missing}: {REGEN_HINT}"
    stale = sorted(checked_in - fresh)
    assert not stale, f"checked-in generated files without a .proto: {stale}: {REGEN_HINT}"
    differ = sorted(n for n in fresh if (fresh_dir / n).read_bytes() != (PROTO_DIR / n).read_bytes())
    assert not differ, f"checked-in generated code is stale: {differ}: {REGEN_HINT}"


def test_generation_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    gen_proto.generate(a)
    gen_proto.generate(b)
    names = _generated_names(a / "proto")
    assert names == _generated_names(b / "proto")
    for n in names:
        assert (a / "proto" / n).read_bytes() == (b / "proto" / n).read_bytes(), n


# ---- (b) round trips ----


def test_generate_request_round_trip():
    from proto import generate_pb2 as pb

    req = pb.GenerateRequest(
        request_id="r-1",
        token_ids=pb.TokenIds(ids=[1, 2, 3, 50000]),
        sampling=pb.SamplingParams(
            max_tokens=16,
            temperature=0.0,
            top_p=0.9,
            top_k=40,
            seed=1234,
            stop=["\n\n", "</s>"],
            stop_token_ids=[2],
            ignore_eos=True,
            logprobs=3,
        ),
        model="tiny",
    )
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("prompt") == "token_ids"
    assert list(back.token_ids.ids) == [1, 2, 3, 50000]
    # explicit presence: temperature 0 (greedy) is distinguishable from unset
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert back.sampling.HasField("seed") and back.sampling.seed == 1234
    assert back.HasField("request_id")

    bare = pb.GenerateRequest.FromString(pb.GenerateRequest(text="hi").SerializeToString())
    assert bare.WhichOneof("prompt") == "text" and bare.text == "hi"
    assert not bare.HasField("request_id")
    assert not bare.sampling.HasField("temperature")
    assert not bare.sampling.HasField("logprobs")
    assert not bare.sampling.HasField("max_tokens")


def test_generate_response_round_trip():
    from proto import generate_pb2 as pb

    resp = pb.GenerateResponse(
        request_id="r-1",
        token_ids=[7, 8],
        text="ab",
        finish_reason="length",
        usage=pb.Usage(prompt_tokens=4, completion_tokens=2),
        timing=pb.Timing(ttft_ms=12.5, kv_transfer_ms=1.25, mean_tpot_ms=3.0),
        logprobs=[pb.TokenLogprob(token_id=7, logprob=-0.5, top=[pb.Logprob(token_id=9, logprob=-1.5)])],
    )
    back = pb.GenerateResponse.FromString(resp.SerializeToString())
    assert back == resp
    assert back.HasField("usage") and back.usage.completion_tokens == 2
    assert back.logprobs[0].top[0].token_id == 9


def test_kv_layer_round_trip():
    from proto import kv_transfer_pb2 as kv

    payload = bytes(range(256)) * 64
    layer = kv.KVLayer(
        transfer_id="t-1",
        auth_token="secret",
        layer=31,
        dtype="bfloat16",
        shape=[2, 4, 16, 8, 64],
        checksum=checksum(payload),
        payload=payload,
        first_block=2,
    )
    back = kv.KVLayer.FromString(layer.SerializeToString())
    assert back == layer
    assert list(back.shape) == [2, 4, 16, 8, 64]
    assert checksum(back.payload) == back.checksum
    assert not back.HasField("compression")

    q = kv.KVLayer(transfer_id="t-1", layer=0, dtype="int8", compression="int8", scales=b"\x00\x00\x80?")
    back_q = kv.KVLayer.FromString(q.SerializeToString())
    assert back_q.HasField("compression") and back_q.compression == "int8"
    assert back_q.scales == b"\x00\x00\x80?"


def test_ticket_and_commit_round_trip():
    from proto import generate_pb2, kv_transfer_pb2, worker_pb2

    ticket = worker_pb2.TransferTicket(
        transfer_id="t-1",
        kv_endpoint="127.0.0.1:5555",
        block_ids=[3, 9, 4],
        compat_hash="abc",
        auth_token="secret",
        num_tokens=40,
        backend="grpc",
    )
    req = worker_pb2.PrefillRequest(request_id="r", token_ids=[1, 2], ticket=ticket)
    assert worker_pb2.PrefillRequest.FromString(req.SerializeToString()).ticket == ticket

    commit = kv_transfer_pb2.KVCommit(
        transfer_id="t-1",
        auth_token="secret",
        first_token=42,
        num_layers=32,
        first_token_logprob=generate_pb2.TokenLogprob(token_id=42, logprob=-0.1),
    )
    back = kv_transfer_pb2.KVCommit.FromString(commit.SerializeToString())
    assert back == commit and back.HasField("first_token_logprob")


# ---- (c) gRPC modules ----

SERVICES = {
    "proto.generate_pb2_grpc": {"PDCluster": ["Generate", "Abort"]},
    "proto.worker_pb2_grpc": {
        "PrefillWorker": ["Prefill", "Abort", "Health", "Stats"],
        "DecodeWorker": ["Reserve", "Stream", "Abort", "Health", "Stats"],
    },
    "proto.kv_transfer_pb2_grpc": {"KVReceiver": ["Handshake", "SendLayers", "Commit", "Abort"]},
}


@pytest.mark.parametrize("module_name", sorted(SERVICES))
def test_grpc_service_stubs_exist(module_name):
    import grpc

    module = importlib.import_module(module_name)
    for service, methods in SERVICES[module_name].items():
        stub_cls = getattr(module, f"{service}Stub")
        servicer_cls = getattr(module, f"{service}Servicer")
        assert callable(getattr(module, f"add_{service}Servicer_to_server"))
        for m in methods:
            assert hasattr(servicer_cls, m), f"{service}Servicer.{m}"
        channel = grpc.insecure_channel("127.0.0.1:1")  # lazy: never connects
        try:
            stub = stub_cls(channel)
            for m in methods:
                assert callable(getattr(stub, m)), f"{service}Stub.{m}"
        finally:
            channel.close()


def test_streaming_shapes():
    from proto import generate_pb2, kv_transfer_pb2, worker_pb2

    def method(pb2, service, name):
        return pb2.DESCRIPTOR.services_by_name[service].methods_by_name[name]

    gen = method(generate_pb2, "PDCluster", "Generate")
    assert gen.server_streaming and not gen.client_streaming
    stream = method(worker_pb2, "DecodeWorker", "Stream")
    assert stream.server_streaming and not stream.client_streaming
    assert stream.output_type.name == "TokenChunk"
    assert method(worker_pb2, "DecodeWorker", "Reserve").output_type.fields_by_name["ticket"]
    send = method(kv_transfer_pb2, "KVReceiver", "SendLayers")
    assert send.client_streaming and not send.server_streaming
    for pb2 in (generate_pb2, worker_pb2, kv_transfer_pb2):
        assert pb2.DESCRIPTOR.package == "pdcluster.v1"
