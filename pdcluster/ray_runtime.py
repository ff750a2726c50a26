"""The Ray a cluster runs on: join one (`ray.address`), start one in this process, or start a
`ray start --head` process of our own (`pdcluster up --detach`), and stop exactly what we started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.net import free_port
from engine.builtin_model import cache_root
from pdcluster.cluster_config import ClusterConfig


class LaunchError(RuntimeError):
    """The cluster could not be brought up; the message says what and why."""


def stop_ray(started: str | None) -> None:
    """Disconnect, and stop the Ray we started: "inprocess", or "head:PID" (our own head process)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if started and started.startswith("head:"):
        _kill_head(int(started.split(":", 1)[1]))


_PROBE = "import sys, ray; ray.init(address=sys.argv[1], logging_level='error'); ray.shutdown()"


def ray_auth_env(address: str, known: str | None = None) -> None:
    """Ray 2.60 turns on token authentication for clusters started with `ray start --head`; a driver
    must then run with RAY_AUTH_MODE=token (the token is in ~/.ray/auth_token or RAY_AUTH_TOKEN).
    Ray reads the setting when it is imported, and workers inherit it, so it must match the
    cluster: use the mode recorded for our own cluster, else probe the cluster once in a
    subprocess. A mode the user set is left alone."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if known is None:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        probe = subprocess.run([sys.executable, "-c", _PROBE, address], env=env, capture_output=True, text=True,
                               timeout=120)
        known = "token" if probe.returncode != 0 and "uthentication" in probe.stderr else "disabled"
    if known == "token":
        os.environ["RAY_AUTH_MODE"] = "token"


def ray_cli() -> str:
    """The `ray` command of the Ray this Python imports: next to the interpreter (a virtual
    environment's bin/, whether or not it is activated), else the first on PATH."""
    beside = Path(sys.executable).with_name("ray")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("ray")
    if found is None:
        raise RuntimeError(f"no `ray` command next to {sys.executable} or on PATH; install ray (pip install ray)")
    return found


def _start_head(port: int, cpus: int) -> int:
    """Start a Ray head owned by this cluster (`ray start --head --block` in its own process group,
    so `down` stops exactly it, never another Ray on the machine). Returns its process id."""
    log_path = cache_root() / f"ray-head-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [ray_cli(), "start", "--head", f"--port={port}", f"--num-cpus={cpus}",
           "--include-dashboard=false", "--disable-usage-stats", "--block"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    try:
        while "Ray runtime started" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"`{' '.join(cmd)}` did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.3)
    except BaseException:  # including Ctrl-C while waiting
        _kill_head(proc.pid)
        raise
    return proc.pid


def _kill_head(pid: int, timeout_s: float = 60.0) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGTERM)  # `ray start --block` stops its GCS and raylet on SIGTERM
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)


def connect(cfg: ClusterConfig, detach: bool, num_cpus: float) -> tuple[str | None, str | None]:
    """Connect this process to Ray. Returns (address to reconnect with, what we started).

    Ray reads RAY_AUTH_MODE when it is imported, so `ray start` runs (and may create the token)
    before this process imports ray."""
    address = cfg.ray.address
    cpus = max(os.cpu_count() or 1, int(num_cpus + 0.999))
    started = None
    if address is None and detach:
        port = free_port()
        address, started = f"127.0.0.1:{port}", f"head:{_start_head(port, cpus)}"
    try:
        if address is not None:
            ray_auth_env(address)
        import ray

        from pdcluster.actors import NAMESPACE

        if address is None:
            ray.init(address="local", namespace=NAMESPACE, num_cpus=cpus, include_dashboard=False,
                     _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
            return None, "inprocess"
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")
        return address, started
    except BaseException:
        stop_ray(started)  # never leave a head we started behind
        raise
