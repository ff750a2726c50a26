"""loadgen.server_counters reads the worker counters the router exports, per phase and per batch size."""

from __future__ import annotations

from prometheus_client import generate_latest

from loadgen.server_counters import as_json, buckets, parse_counters
from proto import worker_pb2 as wk
from router.metrics import RouterMetrics
from router.worker_pool import WorkerHandle


def _phase(phase: str, steps: int, seqs: int, batch_min: int = 0) -> wk.StepPhaseStats:
    return wk.StepPhaseStats(phase=phase, steps=steps, seconds=steps * 0.01, seqs=seqs, tokens=seqs,
                             context_tokens=100 * seqs, batch_min=batch_min)


def test_the_routers_metrics_read_back_per_phase_per_bucket_and_prefix():
    stats = [wk.WorkerStats(worker_id=f"d{i}", role=wk.WORKER_ROLE_DECODE, prompt_tokens=50, prefix_cache_hit_tokens=10,
                            kv_bytes_not_sent=4096, local_prefills=3, kv_bytes_sent={"shm": 100, "grpc": 1},
                            tier_id="host:/dev/shm/pdkv-tier-x:0", tier_saves=5, tier_hits=2,
                            steps=[_phase("decode", 7, 20)],
                            steps_by_batch=[_phase("decode", 2, 2, 1), _phase("decode", 5, 18, 2),
                                            _phase("decode", 9, 9, 0)])  # batch_min 0 is no bucket: left out
             for i in range(2)]
    workers = [WorkerHandle(s.worker_id, "decode", "127.0.0.1:1", channel=None, stub=None, healthy=True, stats=s)
               for s in stats]
    text = generate_latest(RouterMetrics(lambda: workers).registry).decode()
    got = as_json(parse_counters(text))  # summed over the two workers
    assert got["decode/decode"]["steps"] == 14 and got["decode/decode"]["step_seqs"] == 40
    assert got["decode/decode[1]"]["steps"] == 4 and got["decode/decode[2-3]"]["step_seqs"] == 36
    assert got["decode/prefix"] == {"prompt_tokens": 100, "prefix_cache_hit_tokens": 20, "kv_transfer_bytes": 202,
                                    "kv_bytes_not_sent": 8192, "local_prefills": 6, "kv_tier_saves": 10,
                                    "kv_tier_hits": 4}
    assert sorted(k for k in got if k.startswith("decode/decode")) == ["decode/decode", "decode/decode[1]",
                                                                      "decode/decode[2-3]"]
    assert [label for label, _ in buckets(got, "decode", "decode")] == ["1", "2-3"]
    assert buckets(got, "prefill", "decode") == []


def test_samples_without_the_labels_they_need_are_left_out():
    text = (
        "# TYPE pdcluster_worker_steps_total counter\n"
        'pdcluster_worker_steps_total{worker="d0",role="decode",phase="decode"} 3\n'
        'pdcluster_worker_steps_total{worker="d0",role="decode"} 5\n'
        "# TYPE pdcluster_worker_steps_by_batch_total counter\n"
        'pdcluster_worker_steps_by_batch_total{worker="d0",role="decode",phase="decode"} 4\n'
        "# TYPE pdcluster_worker_prompt_tokens_by_batch_total counter\n"  # not a step counter: not a bucket
        'pdcluster_worker_prompt_tokens_by_batch_total{worker="d0",role="decode",batch="1"} 9\n'
    )
    assert parse_counters(text) == {("decode", "decode"): {"steps": 3.0, "step_seconds": 0.0, "step_seqs": 0.0,
                                                           "step_tokens": 0.0, "step_context_tokens": 0.0}}
