"""The SLO controller over a running cluster (pdcluster/live_controller.py): prefill-heavy traffic
on 1 prefill + 2 decode workers presses prefill while decode idles, so the controller moves a
decode worker to prefill in place, from the signals the router and workers measure; every request
completes with transformers' tokens and every block comes back."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from engine import EngineConfig, SamplingParams
from pdcluster.live_controller import LiveController
from pdcluster.local_cluster import LocalCluster
from scaling.policy import ControllerConfig
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[(17 * i + 3 * j) % 400 + 3 for j in range(160 + 8 * (i % 4))] for i in range(240)]


def test_prefill_heavy_traffic_moves_a_decode_worker_to_prefill(checkpoint):
    path = str(checkpoint("llama-gqa"))
    ref = hf_greedy(path)
    cfg = EngineConfig(model=path, dtype="float32", num_blocks=512, max_model_len=256, num_threads=1)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    control = ControllerConfig(interval_s=0.3, settle_intervals=2, cooldown_s=1.0, warmup_s=0.0,
                               slo_ttft_ms=50.0, slo_tpot_ms=50.0)  # first tokens late: prefill pressed for sure
    with LocalCluster(cfg, 1, 2, prefill={"kv_backend": "shm"}, decode={"kv_backend": "shm"},
                      router={"request_timeout_s": 120}) as c, c.client() as client:
        controller = LiveController(c, control).start()
        try:
            with cf.ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda p: client.complete(p, params).token_ids, PROMPTS))
                deadline = time.monotonic() + 10
                while not controller.decisions and time.monotonic() < deadline:
                    time.sleep(0.1)
        finally:
            controller.stop()
        first = controller.decisions[0]
        assert first.flips > 0 and first.prefill_pressure >= control.scale_up_at, first
        assert len(c.prefill_workers) == 2 and len(c.decode_workers) == 1  # decode-x serves prefill now
        r = c.router.metrics.registry
        assert r.get_sample_value("pdcluster_controller_decisions_total",
                                  {"change": "prefill+1 decode-1", "cause": "prefill pressed"}) == 1
        assert r.get_sample_value("pdcluster_controller_target_workers", {"role": "prefill"}) == 2
        assert got == [ref(p, 2) for p in PROMPTS]
        assert client.complete(PROMPTS[0], params).token_ids == got[0]  # the new shape serves
        assert c.wait_blocks_free()
    print(f"decisions: {[(d.action, round(d.prefill_pressure, 2), round(d.decode_pressure, 2)) for d in controller.decisions]}")
