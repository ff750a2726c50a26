"""K/V held for a ticket that follows: a prompt prefilled before the router's reservation on the
decode worker came back keeps each layer's K/V of all its blocks (a copy). Once the ticket is there,
`send_held` sends the blocks the decode worker lacks: whole layers to its KV endpoint, or to each of
its tensor-parallel ranks its own heads (the direct path, kv_transfer/parts.py).
"""

from __future__ import annotations

import torch

from kv_transfer.base import KVSender, KVTransferError, TransferTicket
from kv_transfer.parts import PartItem, PartSend


def send_held(sender: KVSender, ticket: TransferTicket, layers: list[torch.Tensor], first_block: int,
              num_kv_heads: int, in_parts: bool) -> None:
    """Send `layers` (each (2, blocks, block_size, every KV head, head_dim)) from `first_block` on;
    the caller commits. Raises KVTransferError (or the sender's error) on a failure."""
    if not in_parts:
        for layer, kv in enumerate(layers):
            sender.send_layer(ticket, layer, kv[:, first_block:])
        return
    blocks = list(range(first_block, layers[0].shape[1])) if layers else []
    parts = PartSend(sender, 0, 1, num_kv_heads, [PartItem(ticket, blocks)])
    for layer, kv in enumerate(layers):
        parts.send(layer, kv)
    parts.finish()
    if parts.errors[0] is not None:
        raise KVTransferError(parts.errors[0])
