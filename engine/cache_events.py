"""What a worker's prefix cache holds, as a log of stored and evicted block hashes that readers
follow with a cursor (the router's prefix index polls it through the workers' Stats).

The block manager reports each hash it enters into the cache (`stored`) and each it evicts
(`removed`). A reader passes the cursor of its last read and gets the net change since then: a hash
stored and removed in between is only removed, one removed and stored again only stored. A reader
that is new (cursor 0) or fell behind the retained log gets a snapshot of every hash held instead.
Thread-safe: the engine thread writes, gRPC threads read.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class CacheChanges:
    cursor: int  # pass it to the next `since`
    snapshot: bool  # `stored` is everything held (replace what you knew), `removed` is empty
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class CacheEvents:
    def __init__(self, max_events: int = 100_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._lock = threading.Lock()
        self._log: deque[tuple[bytes, bool]] = deque(maxlen=max_events)
        self._next = 1  # sequence number of the next event; the log holds [_next - len(_log), _next)
        self._held: set[bytes] = set()

    def stored(self, h: bytes) -> None:
        with self._lock:
            self._held.add(h)
            self._log.append((h, True))
            self._next += 1

    def removed(self, h: bytes) -> None:
        with self._lock:
            self._held.discard(h)
            self._log.append((h, False))
            self._next += 1

    def since(self, cursor: int) -> CacheChanges:
        """The change since `cursor` (0: never read), or a snapshot when the log no longer reaches back."""
        with self._lock:
            first = self._next - len(self._log)
            if cursor < first or cursor > self._next:
                return CacheChanges(self._next, True, list(self._held))
            net: dict[bytes, bool] = {}
            for i in range(cursor - first, len(self._log)):
                h, stored = self._log[i]
                net[h] = stored
            return CacheChanges(self._next, False, [h for h, s in net.items() if s],
                                [h for h, s in net.items() if not s])
