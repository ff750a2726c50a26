"""Fault injection for KV transfers: drop, delay or corrupt the sender's messages (off by default).

Turned on per prefill worker by a spec string, from `kv_transfer.faults` in cluster.yaml or the
environment variable PDCLUSTER_KV_FAULTS (which wins), e.g.

    PDCLUSTER_KV_FAULTS="drop=0.1,delay_ms=200,corrupt=0.05,seed=1"

    drop=P        a message is lost: a layer never reaches the receiver (its commit is then refused),
                  a commit or abort is not sent and the sender sees DEADLINE_EXCEEDED after its timeout
    corrupt=P     a message is damaged in transit, after its checksum was computed: a layer's payload
                  has a byte flipped (or its checksum, when the bytes travel out of band: shm, tcp,
                  torch_distributed); a commit carries an impossible first token; an abort a wrong
                  auth token. The receiver must refuse each
    delay_ms=MS   a message waits MS milliseconds before it goes (a stalled transfer: more than the
                  transfer timeout), with probability delay=P (1 when delay_ms is given alone)
    on=K1+K2      which messages: layer, commit, abort, handshake (default layer+commit+abort)
    count=N       at most N faults in all, then none (deterministic tests: "the first one fails")
    seed=N        seed of the random draws (default: unseeded)

A gRPC client interceptor on the sender's channels injects them, so they apply to every backend's
control plane (the layers a commit carries count as layers): what a receiver sees is exactly what a
bad network or a hostile peer could send. `FaultInjector.injected` counts what was done.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import grpc

from proto import kv_transfer_pb2

log = logging.getLogger("pdcluster.kv_faults")
ENV = "PDCLUSTER_KV_FAULTS"
KINDS = ("layer", "commit", "abort", "handshake")
_METHOD_KIND = {"SendLayers": "layer", "Commit": "commit", "Abort": "abort", "Handshake": "handshake"}


@dataclass(frozen=True)
class KVFaults:
    drop: float = 0.0
    corrupt: float = 0.0
    delay: float = 0.0
    delay_ms: float = 0.0
    on: tuple[str, ...] = ("layer", "commit", "abort")
    count: int | None = None
    seed: int | None = None

    @classmethod
    def parse(cls, spec: str | None) -> KVFaults | None:
        """A spec string ("drop=0.1,delay_ms=200,seed=1") -> KVFaults; None for "", "off", "none" or None.
        Raises ValueError naming the key for anything else."""
        if spec is None or spec.strip().lower() in ("", "off", "none"):
            return None
        values: dict[str, Any] = {}
        allowed = [f.name for f in fields(cls)]
        for item in spec.split(","):
            key, sep, raw = item.strip().partition("=")
            if not sep or key not in allowed:
                raise ValueError(f"KV faults {spec!r}: {item.strip()!r} is not KEY=VALUE with KEY one of "
                                 f"{', '.join(allowed)}")
            values[key] = _value(key, raw.strip(), spec)
        if "delay_ms" in values and "delay" not in values:
            values["delay"] = 1.0
        faults = cls(**values)
        if not (faults.drop or faults.corrupt or faults.delay * faults.delay_ms):
            raise ValueError(f"KV faults {spec!r}: no fault (set drop, corrupt or delay_ms)")
        return faults

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KVFaults | None:
        return cls.parse((os.environ if env is None else env).get(ENV))


_WANT = {"on": f"kinds joined by '+' among {', '.join(KINDS)}", "count": "an integer >= 0",
         "seed": "an integer >= 0", "delay_ms": "milliseconds >= 0"}


def _value(key: str, raw: str, spec: str) -> Any:
    try:
        if key == "on":
            value: Any = tuple(k for k in raw.split("+") if k)
            ok = bool(value) and all(k in KINDS for k in value)
        elif key in ("count", "seed"):
            value = int(raw)
            ok = value >= 0
        else:
            value = float(raw)
            ok = 0 <= value < float("inf") if key == "delay_ms" else 0.0 <= value <= 1.0
    except ValueError:
        ok = False
    if not ok:
        want = _WANT.get(key, "a probability in [0, 1]")
        raise ValueError(f"KV faults {spec!r}: {key}={raw!r}; allowed: {want}")
    return value


class FaultInjector:
    """Draws the faults of one sender (thread-safe) and provides the channel interceptor doing them."""

    def __init__(self, faults: KVFaults) -> None:
        self.faults = faults
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()
        self.injected: Counter[tuple[str, str]] = Counter()  # (message kind, fault) -> times

    def draw(self, kind: str) -> str | None:
        """"drop", "corrupt", "delay" or None for one message of `kind`."""
        f = self.faults
        if kind not in f.on:
            return None
        with self._lock:
            if f.count is not None and sum(self.injected.values()) >= f.count:
                return None
            x = self._rng.random()
            fault = None
            if x < f.drop:
                fault = "drop"
            elif x < f.drop + f.corrupt:
                fault = "corrupt"
            elif f.delay_ms and self._rng.random() < f.delay:
                fault = "delay"
            if fault is not None:
                self.injected[(kind, fault)] += 1
        if fault is not None:
            log.warning("KV fault injected: %s of a %s message", fault, kind)
        return fault

    def interceptor(self) -> _Interceptor:
        return _Interceptor(self)


def corrupt(msg: Any) -> Any:
    """A damaged copy of a KV message, as a bit flip in transit would leave it."""
    bad = type(msg)()
    bad.CopyFrom(msg)
    if isinstance(bad, kv_transfer_pb2.KVLayer):
        if bad.payload:
            b = bytearray(bad.payload)
            b[len(b) // 2] ^= 0x01
            bad.payload = bytes(b)
        else:  # the bytes travel out of band (shm, tcp, torch_distributed): the checksum is what crossed
            bad.checksum ^= 0x01
            if bad.shm_in_place:  # written into the receiver's cache: make the receiver check the blocks
                bad.shm_checksummed = True
    elif isinstance(bad, kv_transfer_pb2.KVCommit):
        bad.first_token = 0xFFFFFFFF
    elif isinstance(bad, kv_transfer_pb2.KVAbort):
        bad.auth_token = "x" + bad.auth_token[1:]
    elif isinstance(bad, kv_transfer_pb2.HandshakeRequest):
        bad.compat_hash = "corrupted"
    return bad


class _Lost(grpc.RpcError):
    """A dropped request's outcome, DEADLINE_EXCEEDED as on a real network. Raised by the interceptor:
    grpc turns it into a failed future for `.future()` calls."""

    def __init__(self, method: str) -> None:
        super().__init__(f"{method}: lost in transit")
        self._details = f"{method}: the request was lost in transit (KV fault injection: drop)"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


class _Interceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector
        self.delay_s = injector.faults.delay_ms / 1e3

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        if isinstance(request, kv_transfer_pb2.KVCommit) and request.layers:
            request = self._carried_layers(request)
        fault = self.injector.draw(_METHOD_KIND.get(method, ""))
        if fault == "drop":
            if method != "Handshake":  # nobody will answer (a handshake, started under the sender's
                time.sleep(details.timeout if details.timeout is not None else 30.0)  # lock, fails at once)
            raise _Lost(method)
        if fault == "delay":
            time.sleep(self.delay_s)
        elif fault == "corrupt":
            request = corrupt(request)
        return continuation(details, request)

    def _carried_layers(self, commit: Any) -> Any:
        """Layer faults for the layers a commit carries (shm in place), as if they came on a stream."""
        layers = list(self._messages(iter(commit.layers)))
        if len(layers) == len(commit.layers) and all(a is b for a, b in zip(layers, commit.layers)):
            return commit
        changed = type(commit)()
        changed.CopyFrom(commit)
        del changed.layers[:]
        changed.layers.extend(layers)
        return changed

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Iterator[Any]) -> Any:
        return continuation(details, self._messages(request_iterator))

    def _messages(self, messages: Iterator[Any]) -> Iterator[Any]:
        for msg in messages:
            fault = self.injector.draw("layer")
            if fault == "drop":
                continue
            if fault == "delay":
                time.sleep(self.delay_s)
            yield corrupt(msg) if fault == "corrupt" else msg
