"""What both ends of a KV transfer agree on besides proto/kv_transfer.proto: message limits, dtype
names, endpoint addresses, and the gRPC status each refusal travels as."""

from __future__ import annotations

import warnings
from concurrent import futures
from typing import Any

import grpc
import torch

from kv_transfer.base import KVTransferError
from kv_transfer.checksum import NAME as CHECKSUM

MAX_MESSAGE_BYTES = 512 * 1024 * 1024
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# a restarted decode worker is found again within seconds, not gRPC's default of up to two minutes
CHANNEL_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.max_reconnect_backoff_ms", 5000)]

# received payloads are viewed in place (torch.frombuffer over the message's bytes) and only read
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, r"kv_transfer\.")

# wire dtype names, as in the proto ("bfloat16"): str(torch dtype) without the "torch." prefix
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,  # quantized pages: each row's values and its scale as bytes (engine/kv_quant.py)
}


def wire_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def target(endpoint: str) -> str:
    """The gRPC target of a KV endpoint ("grpc://host:port" or "host:port")."""
    return endpoint.removeprefix("grpc://")


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = target(address).rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"bad address {address!r} (expected host:port)")
    return host.strip("[]"), int(port)


class Corrupt(KVTransferError):
    """The bytes do not match their checksum."""

    status = grpc.StatusCode.DATA_LOSS


def check_digest(msg: Any, what: str, digest: int) -> None:
    """Raise `Corrupt` unless `digest` (of the KVLayer's `what`: payload, blocks, ...) is its checksum."""
    if digest != msg.checksum:
        raise Corrupt(f"checksum mismatch for layer {msg.layer} of {msg.transfer_id!r}: "
                      f"{what} {CHECKSUM} {digest:#018x}, message says {msg.checksum:#018x}")


class Unavailable(KVTransferError):
    status = grpc.StatusCode.UNAVAILABLE


class Late(KVTransferError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


def status_for(error: KVTransferError) -> grpc.StatusCode:
    """The gRPC status a receiver's refusal travels as: the error's own `status` (a data plane's
    transport failures, a checksum mismatch) or the one the shared checks' message implies."""
    status = getattr(error, "status", None)
    if isinstance(status, grpc.StatusCode):
        return status
    message = str(error)
    if message.startswith("unknown transfer id"):
        return grpc.StatusCode.NOT_FOUND
    if message.startswith("bad auth token"):
        return grpc.StatusCode.PERMISSION_DENIED
    if message.startswith("commit of") and "before layers" in message:
        return grpc.StatusCode.FAILED_PRECONDITION
    if message.startswith("incompatible"):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT


def rpc_error(what: str, endpoint: str, e: BaseException) -> KVTransferError:
    """A sender's failure of RPC `what`, naming the endpoint, the status and the receiver's reason."""
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return KVTransferError(f"{what} to {endpoint} failed: {e.code().name}: {e.details()}")
    if isinstance(e, (grpc.FutureTimeoutError, TimeoutError)):
        return KVTransferError(f"{what} to {endpoint} timed out")
    if isinstance(e, (grpc.FutureCancelledError, futures.CancelledError)):
        return KVTransferError(f"{what} to {endpoint} was cancelled")
    return KVTransferError(f"{what} to {endpoint} failed: {e!r}")
