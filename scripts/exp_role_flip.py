"""Experiment: what a role flip costs against starting a new worker (issue: the SLO controller).

    python scripts/exp_role_flip.py                        # builtin:tiny-llama, 5 flips each way
    python scripts/exp_role_flip.py --model builtin:llama-200m --flips 3

An in-process cluster (1 prefill + 2 decode workers, shm KV transfer) serves a stream of requests
from 4 client threads while one worker moves decode -> prefill -> decode ... (`LocalCluster.flip`).
Printed: per flip the drain time (what the worker held finishing) and the time out of service
(drained until serving the new role), medians; every output checked against the same prompts
served with no flip; and, for comparison, the time a new worker of each role takes to start from
the checkpoint (its process already up: weights loaded, KV cache allocated, server started).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import threading
import time

from decode_worker.server import DecodeWorkerServer
from engine import EngineConfig, SamplingParams
from engine.builtin_model import resolve_model_path
from pdcluster.local_cluster import LocalCluster
from prefill_worker.server import PrefillWorkerServer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:tiny-llama")
    ap.add_argument("--flips", type=int, default=5, help="flips each way")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    path = str(resolve_model_path(args.model))
    cfg = EngineConfig(model=path, max_model_len=512, num_threads=1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(13 * i + 7 * j) % 4000 + 5 for j in range(16 + 24 * (i % 6))] for i in range(4 * args.flips * 6)]
    flips, outputs = [], []
    with LocalCluster(cfg, 1, 2, prefill={"kv_backend": "shm"}, decode={"kv_backend": "shm"}) as c, \
            c.client() as client:
        want = [client.complete(p, params).token_ids for p in prompts[:8]]  # no flip yet
        stop = threading.Event()

        def load(k: int) -> None:
            i = k
            while not stop.is_set():
                outputs.append((i % len(prompts), client.complete(prompts[i % len(prompts)], params).token_ids))
                i += 4

        with cf.ThreadPoolExecutor(4) as pool:
            loops = [pool.submit(load, k) for k in range(4)]
            time.sleep(1.0)
            worker = "decode-1"
            for n in range(2 * args.flips):
                role = "prefill" if n % 2 == 0 else "decode"
                flips.append((role, c.flip(worker, role)))
                time.sleep(0.3)
            stop.set()
            for f in loops:
                f.result(timeout=120)
        again = [client.complete(p, params).token_ids for p in prompts[:8]]
        assert c.wait_blocks_free(), "KV blocks still held after the flips"
    checked = {i: out for i, out in outputs}
    reference = dict(enumerate(want))
    mismatched = sum(1 for i, out in outputs if i in reference and out != reference[i])
    print(f"model {args.model}; {len(outputs)} requests served during {len(flips)} flips "
          f"({len(checked)} distinct prompts), {mismatched} outputs differing from the no-flip run, "
          f"after the flips the same outputs: {again == want}")
    for role in ("prefill", "decode"):
        mine = [f for r, f in flips if r == role]
        print(f"to {role:7s}: drain median {statistics.median(f.drain_s for f in mine) * 1e3:7.1f} ms, "
              f"out of service median {statistics.median(f.out_of_service_s for f in mine) * 1e3:6.1f} ms "
              f"(max {max(f.out_of_service_s for f in mine) * 1e3:.1f})")
    for name, server in (("prefill", PrefillWorkerServer), ("decode", DecodeWorkerServer)):
        times = []
        for _ in range(3):
            t0 = time.monotonic()
            s = server(cfg, f"fresh-{name}", kv_backend="shm")
            times.append(time.monotonic() - t0)
            s.stop(grace=0.0)
        print(f"a new {name} worker from the checkpoint: median {statistics.median(times) * 1e3:.0f} ms "
              "(in a running process; a Ray actor adds its process start and imports)")
    return 0 if mismatched == 0 and again == want else 1


if __name__ == "__main__":
    sys.exit(main())
