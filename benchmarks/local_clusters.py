"""Servers on this machine for the serving experiments: `pdcluster up` clusters in the foreground,
their cluster files, their health, their warm-up and their stop, all together on the way out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]


def interrupt(signum: int, frame: object) -> None:
    """A SIGTERM handler: raise, so that the experiment's servers are stopped on the way out."""
    raise KeyboardInterrupt(f"signal {signum}")


def experiment_setup(out: str) -> tuple[Path, Any, list[str]]:
    """A serving experiment's start: its output directory (under the repository, made), cluster.yaml's
    SLO and the bench serve flags that apply it; a SIGTERM stops the clusters too (see Servers)."""
    from pdcluster.cluster_config import load_cluster_config

    signal.signal(signal.SIGTERM, interrupt)
    path = (REPO / out).resolve()
    path.mkdir(parents=True, exist_ok=True)
    slo = load_cluster_config(REPO / "cluster.yaml").slo
    return path, slo, ["--slo-ttft-ms", str(slo.ttft_ms), "--slo-tpot-ms", str(slo.tpot_ms)]


def cell(v: Any, spec: str = ".0f") -> str:
    """A report table's cell: `v` formatted, "-" for None."""
    return "-" if v is None else format(v, spec)


def two_cpus() -> tuple[int, int]:
    """The first two CPUs this process may use; exits when there are fewer."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        raise SystemExit(f"needs 2 usable CPUs, this process may use {usable}")
    return usable[0], usable[1]


def write_cluster_files(out: Path, systems: dict[str, Any]) -> dict[str, Path]:
    """Each system's cluster config (validated) as OUT/<name>.yaml; {name: path}."""
    files = {}
    for name, cfg in systems.items():
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg.validate().to_dict(), sort_keys=False))
        files[name] = path
    return files


def start(name: str, config: Path, out: Path, timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`pdcluster up -c config` in the foreground; returns (process, http base URL) once healthy."""
    log = (out / f"{name}.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # its own process group (stopped as one), but this session: Linux's autogroup scheduler shares
    # the CPU between sessions first, so a cluster in a session of its own took an equal share with
    # the load generator whatever the niceness (Ray runs its workers at nice 15), and on 2 busy
    # cores the client fell 0.3-1 s behind its arrival schedule and saw the same gaps in its streams
    proc = subprocess.Popen([sys.executable, "-m", "cli", "up", "-c", str(config), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, process_group=0)
    url = wait_healthy(proc, lambda: _announced_url(out / f"{name}.log"), timeout_s, 1.0)
    if url:
        return proc, url
    stop(proc)
    raise SystemExit(f"{name} did not come up within {timeout_s:.0f} s; see {out / f'{name}.log'}")


def _announced_url(log: Path) -> str | None:
    """The HTTP base URL `pdcluster up` printed into its log, once it has."""
    url = None
    for line in log.read_text().splitlines():
        if "OpenAI API at http://" in line:
            url = line.split("OpenAI API at ")[1].removesuffix("/v1").strip()
    return url


def wait_healthy(proc: subprocess.Popen, find_url: Callable[[], str | None], timeout_s: float, every_s: float,
                 failed: Callable[[], bool] = lambda: False) -> str | None:
    """Poll every `every_s` until the server's /health answers 200 at the URL `find_url` gives (that
    URL), or it exits, `failed()` says it will not come up, or `timeout_s` passes (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if failed():
            break
        url = find_url()
        if url:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(every_s)
    return None


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group, SIGKILL after a minute."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def warm_up(url: str, model: str, words: tuple[int, ...] = (8, 64, 300)) -> None:
    """One completion per prompt length (in words) before anything is measured."""
    for n in words:
        httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": "warm up " * n, "max_tokens": 8, "temperature": 0}).raise_for_status()


class Servers:
    """The servers of one experiment, by name; every one started is stopped when the block ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.urls: dict[str, str] = {}

    def add(self, name: str, started: tuple[subprocess.Popen, str]) -> str:
        """Keep a started server (process, base URL); returns its URL."""
        proc, url = started
        self.procs.append(proc)
        self.urls[name] = url
        return url

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for proc in self.procs:
            stop(proc)


def sweep_clusters(files: dict[str, Path], out: Path, runs: list[tuple[Path, list[str]]],
                   on_up: Callable[[dict[str, str]], None] | None = None) -> int:
    """Start every system's cluster (`files`: name -> cluster file; logs in OUT), warm each up, call
    `on_up(urls)`, then run one interleaved `bench serve` sweep over all of them per run (its output
    directory, its workload and SLO flags); the clusters stop on the way out. Returns the first
    nonzero bench serve exit code, else 0."""
    from benchmarks import rate_sweep

    with Servers() as servers:
        for name, path in files.items():
            print(f"{name}: {servers.add(name, start(name, path, out))}", flush=True)
        urls = servers.urls
        model = httpx.get(f"{next(iter(urls.values()))}/v1/models", timeout=10).json()["data"][0]["id"]
        for url in urls.values():
            warm_up(url, model)
        if on_up is not None:
            on_up(urls)
        for run_out, flags in runs:
            rc = rate_sweep.run_bench_serve(urls, [*flags, "--out", str(run_out)])
            if rc != 0:
                return rc
    return 0
