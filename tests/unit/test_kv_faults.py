"""The KV fault-injection spec (kv_transfer/faults.py): parsing, refusals naming the key, the draws."""

from __future__ import annotations

import pytest

from kv_transfer.faults import FaultInjector, KVFaults, corrupt
from pdcluster.cluster_config import ClusterConfig, ConfigError
from proto import kv_transfer_pb2 as kv


def test_off_by_default_and_parsed_from_a_spec():
    assert KVFaults.from_env({}) is None and KVFaults.parse("off") is None and KVFaults.parse("") is None
    f = KVFaults.parse("drop=0.1,delay_ms=200,corrupt=0.05,seed=1")
    assert (f.drop, f.corrupt, f.delay, f.delay_ms, f.seed) == (0.1, 0.05, 1.0, 200.0, 1)
    assert KVFaults.parse("drop=1,on=commit+abort,count=2").on == ("commit", "abort")
    assert KVFaults.from_env({"PDCLUSTER_KV_FAULTS": "corrupt=1"}).corrupt == 1.0


@pytest.mark.parametrize("spec, word", [
    ("drop=2", "drop"), ("drop", "drop"), ("lose=0.1", "lose"), ("delay_ms=-1", "delay_ms"),
    ("drop=1,on=layers", "on"), ("count=-1,drop=1", "count"), ("seed=1", "no fault"),
])
def test_bad_specs_are_refused_naming_the_key(spec, word):
    with pytest.raises(ValueError, match=word):
        KVFaults.parse(spec)


def test_the_config_key_is_checked_at_load():
    assert ClusterConfig.from_dict({"kv_transfer": {"faults": "drop=0.5"}}).kv_transfer.faults == "drop=0.5"
    assert ClusterConfig.from_dict({}).kv_transfer.faults is None
    with pytest.raises(ConfigError, match=r"kv_transfer\.faults: .*drop"):
        ClusterConfig.from_dict({"kv_transfer": {"faults": "drop=7"}})


def test_draws_follow_the_seed_the_kinds_and_the_count():
    a = FaultInjector(KVFaults.parse("drop=0.3,corrupt=0.3,seed=5"))
    b = FaultInjector(KVFaults.parse("drop=0.3,corrupt=0.3,seed=5"))
    draws = [a.draw("layer") for _ in range(200)]
    assert draws == [b.draw("layer") for _ in range(200)]
    assert 30 < draws.count("drop") < 90 and 30 < draws.count("corrupt") < 90
    assert a.draw("handshake") is None  # not in `on` by default
    once = FaultInjector(KVFaults.parse("drop=1,on=commit,count=1"))
    assert [once.draw("layer"), once.draw("commit"), once.draw("commit")] == [None, "drop", None]
    assert once.injected == {("commit", "drop"): 1}


def test_corruption_happens_after_the_checksum():
    layer = kv.KVLayer(transfer_id="t", payload=b"\x00" * 64, checksum=123)
    bad = corrupt(layer)
    assert bad.payload != layer.payload and bad.checksum == 123 and layer.payload == b"\x00" * 64
    shm = corrupt(kv.KVLayer(transfer_id="t", shm_name="seg", checksum=123))
    assert shm.checksum != 123
    assert corrupt(kv.KVCommit(first_token=5)).first_token == 0xFFFFFFFF
    assert corrupt(kv.KVAbort(auth_token="abcd")).auth_token != "abcd"
