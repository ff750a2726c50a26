"""`auto`'s choice of backend per KV endpoint, as a pure function of what the sender found out, and
the GPU identity its torch_distributed handshake compares (two workers on one GPU: not NCCL)."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.auto import Placement, choose_backend
from kv_transfer.shm_receiver import node_id
from kv_transfer.torch_dist_group import gpu_identity, same_gpu

GPU_A = "host-1/boot-1/0b42632a-bc5c-f731-724b-6936a19c4b24"
GPU_B = "host-1/boot-1/5d1c0e77-0000-4e1a-9c4f-1f2e3d4c5b6a"


@pytest.mark.parametrize(
    "placement, backend",
    [
        (Placement(same_node=True), "shm"),
        (Placement(same_node=True, tcp=True), "shm"),  # shared memory beats a socket on one node
        (Placement(same_node=False, tcp=True), "tcp"),
        (Placement(same_node=False, tcp=False), "grpc"),  # no data port, or it cannot be reached
        (Placement(same_node=False, tcp=True, both_cuda=True), "torch_distributed"),  # GPUs on two nodes
        (Placement(same_node=True, both_cuda=True), "torch_distributed"),  # two GPUs of a node: no host copy
        # one GPU shared by both workers (num_gpus: 0.5 each): the handshake refused a group, so auto
        # sees no CUDA pair (tests/integration/test_kv_transfer_torch_dist.py drives that refusal)
        (Placement(same_node=True, tcp=True), "shm"),
    ],
)
def test_choose_backend(placement, backend):
    assert choose_backend(placement) == backend


def test_placement_defaults_to_nothing_proven():
    assert choose_backend(Placement(same_node=False)) == "grpc"


@pytest.mark.parametrize(
    "mine, theirs, one",
    [
        (GPU_A, GPU_A, True),  # the same GPU of the same node
        (GPU_A, GPU_B, False),  # another GPU of the node
        (GPU_A, "host-2/boot-7/0b42632a-bc5c-f731-724b-6936a19c4b24", False),  # another node
        (GPU_A, "", False),  # the receiver's cache is not on a GPU (or it does not say)
        ("", GPU_A, False),  # this sender is not on a GPU
        ("", "", False),  # CPU caches: gloo pairs them, no GPU is shared
    ],
)
def test_same_gpu_compares_identities(mine, theirs, one):
    assert same_gpu(mine, theirs) is one


def test_a_device_that_is_not_a_gpu_has_no_identity():
    assert gpu_identity(torch.device("cpu")) == ""
    assert gpu_identity(torch.device("meta")) == ""


def test_a_gpu_identity_names_this_node_then_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    ident = gpu_identity(device)
    assert ident.startswith(node_id() + "/") and len(ident) > len(node_id()) + 1
