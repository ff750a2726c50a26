"""Soak test: mixed load on a real cluster for a bounded time, with faults injected on a schedule.

    python scripts/soak.py                          # 10 minutes, 2 prefill + 2 decode, every fault kind
    python scripts/soak.py --duration-s 30 --fault-every-s 12 --faults kill-decode --json soak.json

Load: `--concurrency` client threads, each sending one request after another until the end: prompts of
mixed lengths (a few tokens to several hundred), greedy or seeded sampling, streamed over gRPC or sent
to the OpenAI HTTP API. Every prompt's expected output is taken once from the cluster before any fault,
and every later answer is compared with it token for token (seeded sampling included).

Faults, one every `--fault-every-s` seconds, in turn: kill-decode / kill-prefill (SIGKILL of a live
worker's process; Ray restarts it), kill-router (SIGKILL of the router; Ray restarts it on its port);
and all along, with `--kv-faults`, KV transfer faults (kv_transfer/faults.py: drops, corruptions, delays).
`--secure` serves the public APIs over TLS (a self-signed certificate) with an API key.

The report: requests sent, completed (right tokens), retried (router retries), failed with a clear
error (UNAVAILABLE / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED with a message; HTTP 429 / 503 / 504;
an HTTP connection refused or dropped because the router died or restarts), lost (anything else: wrong or missing tokens, no
final message, an unclear error; must be 0), KV blocks still used by any worker at the end (leaked;
must be 0), and the RSS of every process at start and end. Exit status 1 unless lost and leaked are 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import random
import signal
import ssl
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.soak_mix import Spec, Tally, make_specs
from benchmarks.tls_cert import self_signed
from common.net import fixed_port

FAULTS = ("kill-decode", "kill-prefill", "kill-router")
CLEAR_CODES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")
API_KEY = "soak-key"


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.stop = threading.Event()
        self.faults_done: list[dict[str, Any]] = []
        self.retries_base = 0.0  # retries counted by routers that have since been killed
        self.retries_last = 0.0
        self.tls_ca: str | None = None
        self.handle: Any = None

    # ------------------------------------------------------------------ cluster
    def config(self) -> Any:
        from pdcluster.cluster_config import load_cluster_config

        a = self.args
        cfg = load_cluster_config(a.config)
        pools = (dataclasses.replace(cfg.pools[0], replicas=a.prefill), dataclasses.replace(cfg.pools[1], replicas=a.decode))
        router = dataclasses.replace(cfg.router, grpc_port=fixed_port(), http_port=fixed_port(), max_retries=3)
        if a.secure:
            cert, key = self_signed(tempfile.mkdtemp(prefix="pdcluster-soak-"))
            router = dataclasses.replace(router, tls_cert=cert, tls_key=key, api_keys=(API_KEY,))
            self.tls_ca = cert
        kv = dataclasses.replace(cfg.kv_transfer, faults=a.kv_faults or None, timeout_s=5.0, lease_s=30.0)
        return dataclasses.replace(
            cfg, pools=pools, router=router, kv_transfer=kv,
            kv_cache=dataclasses.replace(cfg.kv_cache, memory_mb=64),
            model=dataclasses.replace(cfg.model, max_model_len=1024),
            engine=dataclasses.replace(cfg.engine, num_threads=1),
        ).validate()

    def membership(self) -> dict[str, Any]:
        import ray

        from pdcluster.actors import CONTROLLER_NAME

        return ray.get(ray.get_actor(CONTROLLER_NAME).membership.remote(), timeout=30)

    def pids(self) -> dict[str, int]:
        import ray

        out = {w["worker_id"]: w["pid"] for w in self.membership()["workers"]}
        try:
            out["router"] = ray.get(ray.get_actor("router").pid.remote(), timeout=10)
        except Exception:
            pass
        out["driver"] = os.getpid()
        return out

    def worker_stats(self) -> dict[str, Any]:
        """worker id -> WorkerStats of every worker that answers now."""
        import grpc

        from proto import worker_pb2 as wk
        from proto import worker_pb2_grpc as wk_grpc
        from proto.cluster_auth import with_secret

        out = {}
        for w in self.membership()["workers"]:
            with with_secret(grpc.insecure_channel(w["address"]), self.handle.secret) as ch:
                stub = wk_grpc.PrefillWorkerStub(ch) if w["role"] == "prefill" else wk_grpc.DecodeWorkerStub(ch)
                try:
                    out[w["worker_id"]] = stub.Stats(wk.StatsRequest(), timeout=5)
                except grpc.RpcError:
                    pass
        return out

    # ------------------------------------------------------------------ requests
    def client(self) -> Any:
        from pdcluster.client import Client

        return Client(self.handle.router_address, api_key=API_KEY if self.args.secure else None, timeout_s=120,
                      tls_ca=self.tls_ca)

    def run_grpc(self, spec: Spec) -> tuple[list[int], str]:
        """(token ids, text) of a streamed gRPC answer."""
        with self.client() as c:
            chunks = list(c.stream(list(spec.prompt), **spec.sampling()))
        if not chunks or not chunks[-1].finish_reason:
            raise AssertionError("the stream ended without a final message")
        return [t for ch in chunks for t in ch.token_ids], "".join(ch.text for ch in chunks)

    def run_http(self, spec: Spec) -> str:
        """The text of an OpenAI /v1/completions answer."""
        import httpx

        scheme = "https" if self.args.secure else "http"
        verify: Any = ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else True
        headers = {"authorization": f"Bearer {API_KEY}"} if self.args.secure else {}
        body = {"prompt": list(spec.prompt), **spec.sampling()}
        r = httpx.post(f"{scheme}://{self.handle.http_address}/v1/completions", json=body, headers=headers,
                       verify=verify, timeout=120)
        if r.status_code != 200:
            raise _HttpError(r.status_code, r.text)
        choice = r.json()["choices"][0]
        if choice["finish_reason"] not in ("length", "stop"):
            raise AssertionError(f"finish_reason {choice['finish_reason']!r}")
        return choice["text"]

    def one(self, spec: Spec, expected: tuple[list[int], str]) -> None:
        import grpc
        import httpx

        via_http = self.rng.random() < self.args.http_share
        try:
            got = self.run_http(spec) if via_http else self.run_grpc(spec)
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
            if code in CLEAR_CODES and details:
                if "failed on a worker" in details:
                    code += ": retries exhausted"
                elif code == "UNAVAILABLE":  # the router itself is not there (killed, restarting)
                    code += ": router unreachable"
                self.tally.add("clear", f"grpc {code}")
            else:
                self.tally.add("lost", f"grpc {code}: {details!r}")
            self.stop.wait(0.2)
            return
        except _HttpError as e:
            if e.status in (429, 503, 504) and '"message"' in e.text:
                self.tally.add("clear", f"http {e.status}")
            else:
                self.tally.add("lost", f"http {e.status}: {e.text[:200]}")
            self.stop.wait(0.2)
            return
        except httpx.ConnectError:  # the router (and its HTTP API) is restarting: refused at once
            self.tally.add("clear", "http connection refused")
            self.stop.wait(0.2)
            return
        except (httpx.RemoteProtocolError, httpx.ReadError):  # the router died with the request: the
            self.tally.add("clear", "http connection lost")  # client knows at once that it failed
            self.stop.wait(0.2)
            return
        except Exception as e:  # noqa: BLE001 (whatever it is, the request is lost)
            self.tally.add("lost", f"{type(e).__name__}: {e}")
            return
        ok = got == (expected[1] if via_http else expected)
        self.tally.add("ok" if ok else "lost", "" if ok else f"output differs from the baseline: {spec}")

    def load(self, specs: list[Spec], expected: dict[Spec, tuple[list[int], str]]) -> None:
        rng = random.Random(self.rng.random())
        while not self.stop.is_set():
            spec = rng.choice(specs)
            self.one(spec, expected[spec])

    # ------------------------------------------------------------------ faults
    def retries(self) -> float:
        import httpx

        scheme = "https" if self.args.secure else "http"
        verify: Any = ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else True
        try:
            text = httpx.get(f"{scheme}://{self.handle.http_address}/metrics", verify=verify, timeout=5).text
        except httpx.HTTPError:
            return self.retries_base + self.retries_last
        now = sum(float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("pdcluster_request_retries_total"))
        if now < self.retries_last:  # a restarted router counts from zero
            self.retries_base += self.retries_last
        self.retries_last = now
        return self.retries_base + now

    def inject(self, kind: str) -> None:
        import ray

        if kind == "kill-router":
            self.retries()
            pid = ray.get(ray.get_actor("router").pid.remote(), timeout=30)
            target = "router"
        else:
            role = kind.removeprefix("kill-")
            live = self.worker_stats()
            workers = [w for w in self.membership()["workers"] if w["role"] == role and w["worker_id"] in live]
            if len(workers) < 2:
                self.faults_done.append({"fault": kind, "skipped": f"fewer than 2 live {role} workers"})
                return
            w = self.rng.choice(workers)
            pid, target = w["pid"], w["worker_id"]
        os.kill(pid, signal.SIGKILL)
        self.faults_done.append({"fault": kind, "target": target, "pid": pid, "at_s": round(time.monotonic() - self.t0, 1)})
        print(f"[{time.monotonic() - self.t0:6.1f} s] {kind}: {target} (pid {pid})", flush=True)

    def faults(self) -> None:
        kinds = [k for k in self.args.faults.split(",") if k]
        i = 0
        while kinds and not self.stop.wait(self.args.fault_every_s):
            self.inject(kinds[i % len(kinds)])
            i += 1
            self.retries()

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        from pdcluster.launcher import up

        self.handle = up(self.config(), say=lambda m: print(m, flush=True))
        try:
            return self._run()
        finally:
            self.handle.stop()

    def _run(self) -> dict[str, Any]:
        a = self.args
        pids_start = self.pids()
        rss_start = {name: rss_mib(pid) for name, pid in pids_start.items()}
        specs = make_specs(a.prompts, self.rng)
        expected = {s: self.run_grpc(s) for s in specs}  # before any fault (KV faults are retried)
        print(f"baseline of {len(specs)} prompts taken; load for {a.duration_s:.0f} s", flush=True)
        self.t0 = time.monotonic()
        with cf.ThreadPoolExecutor(a.concurrency + 1) as pool:
            loads = [pool.submit(self.load, specs, expected) for _ in range(a.concurrency)]
            faults = pool.submit(self.faults)
            self.stop.wait(a.duration_s)
            self.stop.set()
            for f in [*loads, faults]:
                f.result(timeout=300)
        elapsed = time.monotonic() - self.t0
        leaked = self.settle(a.settle_s)
        pids_end = self.pids()
        retried = self.retries()
        t = self.tally
        report = {
            "duration_s": round(elapsed, 1), "concurrency": a.concurrency,
            "workers": {"prefill": a.prefill, "decode": a.decode}, "kv_faults": a.kv_faults or None,
            "secure": a.secure, "sent": t.sent, "completed": t.completed, "retried": int(retried),
            "failed_clear": sum(t.failed_clear.values()), "failed_clear_by_reason": dict(t.failed_clear),
            "lost": len(t.lost), "lost_examples": t.lost[:10], "kv_blocks_leaked": leaked,
            "faults": self.faults_done,
            "rss_mib": {name: {"start": rss_start.get(name), "end": rss_mib(pids_end[name]) if name in pids_end else None,
                               "pid_start": pids_start.get(name), "pid_end": pids_end.get(name)}
                        for name in sorted(set(pids_start) | set(pids_end))},
        }
        return report

    def settle(self, timeout_s: float) -> dict[str, int]:
        """KV blocks used per worker once every worker answers and holds none, or at the timeout."""
        names = {w["worker_id"] for w in self.membership()["workers"]}
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.worker_stats()
            used = {wid: s.kv_blocks_used for wid, s in stats.items()}
            if (set(used) == names and not any(used.values())) or time.monotonic() > deadline:
                return {wid: used.get(wid, -1) for wid in sorted(names) if used.get(wid, -1) != 0}
            time.sleep(0.5)


class _HttpError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.text = status, text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the load runs (default 600)")
    p.add_argument("--config", default="cluster.yaml", help="cluster.yaml to start from (pools are resized)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--concurrency", type=int, default=8, help="client threads (default 8)")
    p.add_argument("--http-share", type=float, default=0.3, help="share of requests sent to the HTTP API")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts in the mix (default 16)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in turn: {', '.join(FAULTS)}")
    p.add_argument("--fault-every-s", type=float, default=60.0, help="seconds between faults (default 60)")
    p.add_argument("--kv-faults", default="drop=0.01,corrupt=0.01,delay=0.02,delay_ms=300,seed=7",
                   help="KV transfer fault spec for the prefill workers ('' for none)")
    p.add_argument("--secure", action="store_true", help="TLS (self-signed) and an API key on the public APIs")
    p.add_argument("--settle-s", type=float, default=60.0, help="how long to wait for restarts and freed blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the report to this file")
    args = p.parse_args(argv)
    bad = [k for k in args.faults.split(",") if k and k not in FAULTS]
    if bad:
        p.error(f"--faults: {', '.join(bad)} not among {', '.join(FAULTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Soak(args).run()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if report["lost"] == 0 and not report["kv_blocks_leaked"] and report["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
