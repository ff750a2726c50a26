"""`auto`'s choice of backend per KV endpoint, as a pure function of what the sender found out."""

from __future__ import annotations

import pytest

from kv_transfer.auto import Placement, choose_backend


@pytest.mark.parametrize(
    "placement, backend",
    [
        (Placement(same_node=True), "shm"),
        (Placement(same_node=True, tcp=True), "shm"),  # shared memory beats a socket on one node
        (Placement(same_node=False, tcp=True), "tcp"),
        (Placement(same_node=False, tcp=False), "grpc"),  # no data port, or it cannot be reached
        (Placement(same_node=False, tcp=True, both_cuda=True), "torch_distributed"),
        (Placement(same_node=True, both_cuda=True), "torch_distributed"),  # GPU to GPU, no host copy
    ],
)
def test_choose_backend(placement, backend):
    assert choose_backend(placement) == backend


def test_placement_defaults_to_nothing_proven():
    assert choose_backend(Placement(same_node=False)) == "grpc"
