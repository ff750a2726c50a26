"""A fixed port for a server that must come back on the same port (a restarted router, a shell's
cluster.yaml), chosen below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range,
32768-60999 by default): a port-0 bind elsewhere -- a worker's gRPC server, a Ray process -- can
never be handed the same one between the choice and the bind, as it could with a port found by
binding port 0 and closing it."""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32000


def fixed_port() -> int:
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(LOW, HIGH)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{LOW}, {HIGH})")
