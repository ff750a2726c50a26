"""The direct KV path on a tensor-parallel decode worker's other ranks: each runs a KV receiver of
the worker's backend on a gRPC server of its own, which writes the parts sent to it (its KV heads of
a transfer, kv_transfer/parts.py) into its own cache. Rank 0 puts every rank's endpoint in the
tickets it hands out, and asks each rank (engine/tp_steps.py CALL) to expect a transfer, to settle it
(whether its parts all came; if so it is done there), or to forget it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sequence import TokenLogprobs
from kv_transfer import KVReceiver, KVTransferError, TransferTicket, create_receiver
from proto.cluster_auth import server_interceptors
from proto.serving import bind_server

log = logging.getLogger("pdcluster.decode")


class RankSink:
    """A rank's cache as a `KVSink` that takes parts only (its heads of a transfer; rank 0 commits)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.compat_hash = runner.compat_hash
        self.num_layers = len(runner.kv_caches)
        layout = runner.tp.layout
        self.kv_heads = (layout.first_kv_head, layout.kv_heads)
        self.kv_dtype = runner.cache_dtype  # the receiver's wire-dtype check
        self.cache = runner.kv_caches[0]  # where the cache lives (the receiver's planes: NCCL on CUDA)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.runner.kv_layer_shape(num_blocks)

    def write_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor, first_block: int = 0) -> None:
        if not ticket.num_heads:
            raise KVTransferError(f"{ticket.transfer_id!r}: a tensor-parallel rank other than 0 takes parts only")
        blocks = ticket.block_ids[first_block:first_block + kv.shape[1]]
        self.runner.write_local(layer, blocks, kv, ticket.first_head - self.kv_heads[0])

    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None:
        raise KVTransferError(f"{ticket.transfer_id!r} commits at rank 0 of the decode worker, not here")

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        """The blocks are rank 0's to free."""


@dataclass
class DecodeRankKV:
    """Given to each other rank of a decode worker (engine/tp_steps.py `RankKV`)."""

    backend: str
    host: str = "127.0.0.1"
    cluster_secret: str | None = None
    options: dict = field(default_factory=dict)  # more keyword arguments of the backend's receiver
    receiver: KVReceiver | None = field(default=None, init=False, repr=False)

    def __getstate__(self) -> dict:  # what travels to the rank's process: the settings only
        return {**self.__dict__, "receiver": None}

    def start(self, runner: Any) -> list[int]:
        server, address = bind_server(self.host, 0, 16, f"KV receiver of tensor-parallel rank {runner.tp.layout.rank}",
                                      interceptors=server_interceptors(self.cluster_secret, "kv receiver"))
        options = {k: v for k, v in self.options.items() if k != "in_place"}  # a rank's cache stays private
        self.receiver = create_receiver(self.backend, RankSink(runner), server=server, endpoint=address, **options)
        server.start()
        self._server = server
        return [int(address.rsplit(":", 1)[1])]

    def endpoints(self, rank_info: list[list[int]]) -> list[str]:
        """Rank 0: the other ranks' KV endpoints from what they reported."""
        return [f"{self.host}:{info[0]}" for info in rank_info]

    def parts(self, payload: bytes, runner: Any) -> Any:
        raise KVTransferError("a decode worker's ranks send no KV")

    def call(self, request: dict) -> dict:
        op, receiver = request.get("op"), self.receiver
        if op == "expect":
            receiver.expect(TransferTicket(**request["ticket"]))
            return {}
        if op == "settle":  # rank 0 commits the transfer once every rank has its heads: then forgotten here
            missing = receiver.parts_missing(request["id"])
            if missing is None:
                receiver.forget(request["id"])
            return {"missing": missing}
        if op == "forget":
            receiver.forget(request["id"])
            return {}
        raise ValueError(f"unknown request {op!r}")

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self._server.stop(grace=None)
