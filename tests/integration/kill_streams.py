"""Streams that a process kill interrupts: shared by the fault tests."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable

from pdcluster.client import Client


def streams_through_a_kill(router_address: str, prompts: list[list[int]], n: int, kill: Callable[[], None],
                           begun: int = 3) -> list[list[int]]:
    """Stream every prompt at once (greedy, `n` tokens); call `kill` once each has `begun` tokens;
    each stream's tokens."""
    started = [threading.Event() for _ in prompts]

    def run(i: int) -> list[int]:
        tokens: list[int] = []
        with Client(router_address, timeout_s=120) as client:
            for chunk in client.stream(prompts[i], max_tokens=n, temperature=0.0, ignore_eos=True):
                tokens += chunk.token_ids
                if len(tokens) >= begun:
                    started[i].set()
        return tokens

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, i) for i in range(len(prompts))]
        assert all(e.wait(120) for e in started), "streams did not start"
        kill()
        return [f.result(timeout=240) for f in futures]
