"""The cluster checks of scripts/gpu_check.py: a disaggregated cluster brought up by the product's
own launcher (`pdcluster up -c FILE --detach`, then `pdcluster down`), greedy tokens through its
gRPC client and its OpenAI HTTP API, and the KV backend that carried the prompts' KV, read from
the router's /metrics (`pdcluster_worker_kv_transfer_bytes`, labelled by backend).

The cluster gets a private $PDCLUSTER_CACHE (its state file and Ray head log), so it never meets
another detached cluster on the machine; its model is a directory path, so nothing is written there.
Every wait is bounded: each command by a subprocess timeout, each request by its own deadline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 180  # timeouts.startup_s of the cluster; `up` itself gives up after it
REQUEST_S = 60.0  # each request through the cluster (gRPC deadline, HTTP timeout)
METRICS_WAIT_S = 15.0  # the router polls worker Stats every 0.5 s; the KV bytes show up after a poll

# callables that stop what is running (a cluster that is up): gpu_check's budget watchdog calls them
CLEANUPS: list[Callable[[], None]] = []


@dataclass(frozen=True)
class ClusterSpec:
    """One prefill and one decode worker of `model` (a checkpoint directory) on `device`."""

    model: str
    device: str  # "cuda" or "cpu"
    dtype: str = "float32"
    backend: str = "auto"  # kv_transfer.backend
    gpus_per_worker: float = 0.5  # resources.num_gpus of each worker on cuda

    def to_yaml(self) -> str:
        """The cluster.yaml (pdcluster/cluster_config.py's schema): free router ports, a fixed KV
        cache (the default on CUDA, 90% of free memory, would leave nothing for the second worker)."""
        resources: dict[str, float] = {"num_cpus": 1}
        if self.device == "cuda":
            resources["num_gpus"] = self.gpus_per_worker
        hardware = "gpu" if self.device == "cuda" else "cpu"
        pools = [{"name": role, "role": role, "replicas": 1, "hardware": hardware, "resources": resources}
                 for role in ("prefill", "decode")]
        return yaml.safe_dump({
            "model": {"path": self.model, "dtype": self.dtype, "max_model_len": 512},
            "mode": "disaggregated",
            "router": {"grpc_port": 0, "http_port": 0},
            "pools": pools,
            "kv_cache": {"block_size": 16, "num_blocks": 256},
            "kv_transfer": {"backend": self.backend, "timeout_s": 30},
            "timeouts": {"startup_s": STARTUP_S, "request_s": REQUEST_S},
        }, sort_keys=False)


def _up(config: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """`pdcluster up -c CONFIG --detach`. Interrupted (SIGINT) when it runs past `timeout_s` or the
    run's budget is spent meanwhile: `up` then stops the Ray head and the actors it started."""
    proc = subprocess.Popen([sys.executable, "-m", "cli", "up", "-c", str(config), "--detach"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # SIGINT is ignored in a background job (`cmd &`), and children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def interrupt() -> None:
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()

    CLEANUPS.append(interrupt)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        interrupt()
        out, err = proc.communicate(timeout=30)
        err += f"\npdcluster up: not done after {timeout_s:.0f}s; interrupted"
    finally:
        CLEANUPS.remove(interrupt)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _tail(proc: subprocess.CompletedProcess) -> str:
    """The last line of what a failed command said (its whole stderr goes to ours)."""
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def _http(url: str, body: dict | None = None, timeout_s: float = REQUEST_S) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return resp.read()


def kv_backends(metrics_text: str) -> dict[str, float]:
    """Backend -> KV bytes sent, from the router's Prometheus text (`pdcluster_worker_kv_transfer_bytes`)."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = re.match(r'pdcluster_worker_kv_transfer_bytes(?:_total)?\{.*backend="([^"]+)".*\}\s+(\S+)', line)
        if m and float(m.group(2)) > 0:
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
    return found


def differences(prompts: list[list[int]], got: list[list[int]], want: list[list[int]],
                labels: list[str]) -> list[str]:
    """"<label> prompt of N tokens: token i differs" for each answer that is not the one wanted."""
    out = []
    for prompt, g, w, label in zip(prompts, got, want, labels):
        if g != w:
            i = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            out.append(f"{label} prompt of {len(prompt)} tokens: token {i} differs")
    return out


def _backend_used(http_address: str) -> dict[str, float]:
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        used = kv_backends(_http(f"http://{http_address}/metrics", timeout_s=10).decode())
        if used or time.monotonic() > deadline:
            return used
        time.sleep(0.5)


def _generate(router: str, http_address: str, model: str, prompts: list[list[int]],
              n: int) -> list[list[int]]:
    """Greedy tokens: every prompt but the last through the gRPC client, the last through HTTP."""
    from pdcluster import SamplingParams
    from pdcluster.client import Client

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with Client(router, timeout_s=REQUEST_S) as client:
        got = [client.complete(p, params).token_ids for p in prompts[:-1]]
    answer = json.loads(_http(f"http://{http_address}/v1/completions", {
        "model": model, "prompt": prompts[-1], "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}))
    return got + [answer["choices"][0]["token_ids"]]


def cluster_check(spec: ClusterSpec, prompts: list[list[int]], want: list[list[int]],
                  expect: tuple[str, ...]) -> tuple[str, str]:
    """Up, generate, compare with `want` (transformers' greedy tokens), read the KV backend, down.
    PASS when every token matches and the backend is one of `expect`."""
    work = Path(tempfile.mkdtemp(prefix="gpu-check-cluster-"))
    config = work / "cluster.yaml"
    config.write_text(spec.to_yaml())
    env = {**os.environ, "PDCLUSTER_CACHE": str(work / "cache")}
    up = _up(config, env, STARTUP_S + 120)
    if up.returncode != 0:
        return "FAIL", f"pdcluster up: {_tail(up)} (logs: {work})"

    def down() -> str | None:
        try:
            CLEANUPS.remove(down)  # once: by this check, or by the budget's watchdog
        except ValueError:
            return None
        proc = subprocess.run([sys.executable, "-m", "cli", "down"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=180)
        return None if proc.returncode == 0 else f"pdcluster down: {_tail(proc)}"

    CLEANUPS.append(down)
    try:
        router = re.search(r"router gRPC\s+(\S+)", up.stdout).group(1)
        http_address = re.search(r"OpenAI API at http://([^/\s]+)", up.stdout).group(1)
        got = _generate(router, http_address, spec.model, prompts, len(want[0]))
        used = _backend_used(http_address)
    finally:
        down_error = down()
    bad = differences(prompts, got, want, ["gRPC"] * (len(prompts) - 1) + ["HTTP"])
    backend = "+".join(sorted(used)) or "none"
    detail = f"KV backend {backend}, {len(prompts)} prompts x {len(want[0])} tokens"
    if bad or down_error or backend not in expect:
        problems = bad + ([down_error] if down_error else [])
        if backend not in expect:
            problems.append(f"expected KV backend {' or '.join(expect)}")
        return "FAIL", f"{detail}: {'; '.join(problems)} (logs: {work})"
    shutil.rmtree(work, ignore_errors=True)
    return "PASS", f"{detail}, token-identical to transformers"
