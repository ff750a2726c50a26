"""A worker changes role in place under load (pdcluster/role_flip.py): requests in flight on it
finish, new ones go to the others meanwhile, its new server runs on the weights and the KV cache
memory it held; every
output equals transformers' greedy one, every KV block comes back, and the flip itself takes well
under a second of service on the tiny model."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from engine import EngineConfig, SamplingParams
from pdcluster.local_cluster import LocalCluster
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow

N = 16
PROMPTS = [[(11 * i + 5 * j) % 400 + 3 for j in range(12 + 9 * (i % 5))] for i in range(24)]


@pytest.fixture(scope="module")
def path(checkpoint):
    return str(checkpoint("llama-gqa"))


def test_flips_under_load_lose_nothing_and_take_under_a_second(path):
    ref = hf_greedy(path)
    cfg = EngineConfig(model=path, dtype="float32", num_blocks=96, max_model_len=256, num_threads=1)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    with LocalCluster(cfg, 1, 2, prefill={"kv_backend": "shm"}, decode={"kv_backend": "shm"},
                      router={"request_timeout_s": 60}) as c, c.client() as client:
        model = c.decode_workers[1].engine.runner.model
        kv = [t.data_ptr() for t in c.decode_workers[1].engine.runner.kv_caches]  # its shared-memory cache
        with cf.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(lambda p: client.complete(p, params).token_ids, p) for p in PROMPTS]
            deadline = time.monotonic() + 30
            while c.decode_workers[1].in_flight() == 0 and time.monotonic() < deadline:
                time.sleep(0.002)
            assert c.decode_workers[1].in_flight() > 0  # under load: what it holds finishes first
            to_prefill = c.flip("decode-1", "prefill")
            to_decode = c.flip("prefill-0", "decode")
            got = [f.result(timeout=120) for f in futures]
        assert got == [ref(p, N) for p in PROMPTS]
        assert to_prefill.drain_s > 0 and [w.worker_id for w in c.prefill_workers] == ["decode-1"]
        assert sorted(w.worker_id for w in c.decode_workers) == ["decode-0", "prefill-0"]
        assert c.prefill_workers[0].engine.runner.model is model  # the same weights, not reloaded
        assert [t.data_ptr() for t in c.prefill_workers[0].engine.runner.kv_caches] == kv  # the same KV memory
        for flip in (to_prefill, to_decode):
            assert flip.out_of_service_s < 1.0, flip
        # the cluster in its new shape serves, and gives every block back
        assert client.complete(PROMPTS[3], params).token_ids == ref(PROMPTS[3], N)
        assert c.wait_blocks_free()
    print(f"flip to prefill: drained in {to_prefill.drain_s * 1e3:.0f} ms, out of service "
          f"{to_prefill.out_of_service_s * 1e3:.0f} ms; to decode: {to_decode.drain_s * 1e3:.0f} / "
          f"{to_decode.out_of_service_s * 1e3:.0f} ms")


def test_a_flip_that_cannot_happen_is_refused(path):
    cfg = EngineConfig(model=path, dtype="float32", num_blocks=32, max_model_len=128, num_threads=1)
    with LocalCluster(cfg, 1, 1) as c:
        with pytest.raises(ValueError, match="last worker of its role"):
            c.flip("decode-0", "prefill")
        with pytest.raises(ValueError, match="no worker 'nope'"):
            c.flip("nope", "prefill")
        with pytest.raises(ValueError, match="role must be prefill or decode"):
            c.flip("decode-0", "colocated")
    with LocalCluster(cfg, 0, 2, mode="colocated") as c, pytest.raises(ValueError, match="colocated"):
        c.flip("colocated-0", "prefill")
