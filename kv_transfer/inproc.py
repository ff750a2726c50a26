"""In-process backend (the offline `LLM`): the receiver registers under `inproc://NAME`, where the
sender finds it and hands the layer tensor to its shared checks."""

from __future__ import annotations

import itertools
import threading

import torch

from engine.sequence import TokenLogprobs
from kv_transfer.base import KVReceiver, KVSender, KVSink, KVTransferError, TransferTicket
from kv_transfer.compression import roundtrip

_receivers: dict[str, InprocReceiver] = {}
_lock = threading.Lock()
_ids = itertools.count()


class InprocReceiver(KVReceiver):
    def __init__(self, sink: KVSink, name: str | None = None) -> None:
        super().__init__(sink)
        self._endpoint = f"inproc://{name or f'decode-{next(_ids)}'}"
        with _lock:
            if self._endpoint in _receivers:
                raise KVTransferError(f"endpoint {self._endpoint} is already taken")
            _receivers[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def close(self) -> None:
        with _lock:
            _receivers.pop(self._endpoint, None)


class InprocSender(KVSender):
    sends_parts = False  # in this process only: a tensor-parallel worker's other ranks cannot reach it

    def __init__(self, compat_hash: str, compression: str = "none") -> None:
        super().__init__(compat_hash)
        roundtrip(torch.zeros(2, 1, 1, 1, 1), compression)  # refuse an unknown compression now
        self.compression = compression

    @staticmethod
    def _receiver(ticket: TransferTicket) -> InprocReceiver:
        receiver = _receivers.get(ticket.kv_endpoint)
        if receiver is None:
            raise KVTransferError(f"no in-process KV receiver at {ticket.kv_endpoint!r}")
        return receiver

    def send_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> None:
        self.check_ticket(ticket)
        kv = roundtrip(kv, self.compression)  # what the receiver would get over the wire
        self._receiver(ticket)._on_layer(ticket.transfer_id, ticket.auth_token, layer, kv)

    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None:
        self._receiver(ticket)._on_commit(ticket.transfer_id, ticket.auth_token, first_token, logprob)

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        self._receiver(ticket)._on_abort(ticket.transfer_id, ticket.auth_token, reason)
