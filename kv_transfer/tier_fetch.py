"""The offload tier between nodes: a worker reads blocks of another node's tier (engine/kv_tier.py)
into its own node's tier, over gRPC between the workers (the cluster secret on every call), before
its engine looks for them.

    router     the prompt's leading blocks are in node A's tier, not in node B's, where the prefill
               worker it chose runs: PrefillRequest.tier_source = (a worker of node A, blocks)
    worker B   TierFetcher.fetch: ReadTier(hashes it lacks) from that worker, each block's file
               written into node B's tier as received; then the prompt is queued, and the engine's
               prefix-cache lookup recalls the blocks from node B's tier like any other
    worker A   serve_blocks: the blocks its tier holds, in prompt order, up to the first it lacks

A block travels as the tier stores it (header, token ids, bytes), so the reader's usual checks
(layout, hash, parent, tokens) apply on arrival. A fetch that fails or times out only leaves the
engine more to compute: it never fails the request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc

from engine.kv_tier import KVTier
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.cluster_auth import with_secret

log = logging.getLogger(__name__)

MAX_BLOCKS = 4096  # blocks one ReadTier call may ask for (a 64k-token prompt at 16 tokens a block)


def serve_blocks(tier: KVTier | None, request: wk.ReadTierRequest) -> Iterator[wk.TierBlock]:
    """ReadTier's answer: the asked-for blocks this tier holds, in order, up to the first it lacks
    (a prompt's blocks are only of use as a leading run)."""
    if tier is None:
        return
    for h in list(request.hashes)[:MAX_BLOCKS]:
        data = tier.read_file(h)
        if data is None:
            return
        yield wk.TierBlock(hash=h, data=data)


class TierFetcher:
    """One worker's reads from other nodes' tiers: a channel per source address, kept."""

    def __init__(self, tier: KVTier, secret: str | None, timeout_s: float = 5.0) -> None:
        self.tier = tier
        self.secret = secret
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self.blocks_fetched = 0  # cumulative
        self.bytes_fetched = 0

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = with_secret(grpc.insecure_channel(address), self.secret)
            return self._channels[address]

    def fetch(self, source: wk.TierSource, hashes: list[bytes]) -> int:
        """Copy the leading blocks of `hashes` that this tier lacks from the tier of the worker
        `source` names into this one; returns how many arrived. Any failure ends the fetch early (logged)."""
        address = source.address
        want = [h for h in hashes[:MAX_BLOCKS] if not self.tier.holds(h)]
        if not want:
            return 0
        got = 0
        t0 = time.perf_counter()
        try:
            stub_class = wk_grpc.PrefillWorkerStub if source.role == wk.WORKER_ROLE_PREFILL else wk_grpc.DecodeWorkerStub
            stream = stub_class(self._channel(address)).ReadTier(wk.ReadTierRequest(hashes=want), timeout=self.timeout_s)
            for block in stream:
                if not self.tier.put_file(block.hash, block.data):
                    break
                got += 1
                self.bytes_fetched += len(block.data)
        except grpc.RpcError as e:
            log.warning("reading %d tier blocks from %s failed after %d: %s %s", len(want), address, got,
                        e.code().name, e.details())
        self.blocks_fetched += got
        log.debug("read %d of %d tier blocks from %s in %.1f ms", got, len(want), address,
                  1000 * (time.perf_counter() - t0))
        return got

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
