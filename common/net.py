"""Ports for servers.

`free_port()` is one the OS picks from its ephemeral range: fine for a server that binds it at once
and never rebinds. `fixed_port()` is for a server that must come back on the same port (a router
restarted by Ray, a port written into a cluster.yaml): it is chosen below the kernel's ephemeral
range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), so a port-0 bind elsewhere
(a worker's gRPC server, a Ray process) can never be handed it between the choice and the bind, as
it could with a port found by binding port 0 and closing it.
"""

from __future__ import annotations

import random
import socket

FIXED_LOW, FIXED_HIGH = 20000, 32000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def fixed_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, below the ephemeral range (see above)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(FIXED_LOW, FIXED_HIGH)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{FIXED_LOW}, {FIXED_HIGH})")
