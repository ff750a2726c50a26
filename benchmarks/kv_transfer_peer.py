"""The transfer benchmark's receiving process, as a decode worker is one: a real `DecodeEngine` per
backend over a tiny random checkpoint of the layout, driven over a pipe (reserve, abort, the limits'
receiving ends); and the timed transfer of one prompt's KV into it from this process."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import socket
import threading
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from benchmarks.kv_transfer_layouts import BACKENDS, BLOCK_SIZE, Layout
from benchmarks.kv_transfer_limits import grpc_raw_sink, socket_sink


def _write_checkpoint(out: Path, lay: Layout, max_len: int) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=lay.layers,
        num_attention_heads=lay.kv_heads, num_key_value_heads=lay.kv_heads, head_dim=lay.head_dim,
        max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(getattr(torch, lay.dtype)).save_pretrained(out)
    return out


class _Receiver:
    """One decode Engine for a layout; a DecodeEngine per backend over it (reserved serially)."""

    def __init__(self, lay: Layout, max_tokens: int, workdir: Path) -> None:
        from decode_worker import DecodeEngine
        from engine import Engine, EngineConfig

        path = _write_checkpoint(workdir / lay.name, lay, max_tokens + BLOCK_SIZE)
        blocks = -(-max_tokens // BLOCK_SIZE) + 2
        cfg = EngineConfig(model=str(path), dtype=lay.dtype, device="cpu", num_blocks=blocks,
                           max_model_len=max_tokens + BLOCK_SIZE, enable_prefix_caching=False,
                           kv_cache_dtype=lay.kv_cache_dtype)
        self.engine = Engine(cfg, "decode")
        self.decoders = {b: DecodeEngine(self.engine, backend=b) for b in BACKENDS}

    def close(self) -> None:
        for d in self.decoders.values():
            d.close()


def receiving_process(conn: Connection, lay: dict, max_tokens: int, workdir: str, threads: int | None) -> None:
    """The receiving process: a `_Receiver` for one layout, driven by JSON requests over `conn`."""
    from engine import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    recv = _Receiver(Layout(**lay), max_tokens, Path(workdir))
    sockets: list[tuple[socket.socket, threading.Thread]] = []
    raw = grpc_raw_sink()
    reply: dict = {"hashes": {b: d.compat_hash for b, d in recv.decoders.items()}, "raw_port": raw.port}
    try:
        while True:
            conn.send_bytes(json.dumps(reply).encode())
            req = json.loads(conn.recv_bytes())
            op, reply = req.pop("op"), {}
            if op == "reserve":
                rid = uuid.uuid4().hex
                ticket = recv.decoders[req["backend"]].reserve(rid, [5] * req["tokens"], SamplingParams(max_tokens=1))
                reply = {"rid": rid, "ticket": dataclasses.asdict(ticket) if ticket is not None else None}
            elif op == "abort":
                recv.decoders[req["backend"]].abort_request(req["rid"])  # frees the blocks for the next one
            elif op == "socket":
                sockets.append(socket_sink(req["total"]))
                reply = {"port": sockets[-1][0].getsockname()[1]}
            elif op == "socket_done":
                srv, t = sockets.pop()
                t.join()
                srv.close()
            elif op == "stop":
                return
    finally:
        raw.stop(None)
        recv.close()


class Peer:
    """This process's end of the receiving process."""

    def __init__(self, lay: Layout, max_tokens: int, workdir: Path, threads: int | None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiving_process, daemon=True, name=f"bench-receiver-{lay.name}",
                                args=(child, dataclasses.asdict(lay), max_tokens, str(workdir), threads))
        self.proc.start()
        child.close()
        hello = self._recv()
        self.hashes: dict[str, str] = hello["hashes"]
        self.raw_port: int = hello["raw_port"]

    def _recv(self, timeout: float = 600.0) -> dict:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the receiving process did not answer within {timeout:.0f} s")
        return json.loads(self.conn.recv_bytes())

    def call(self, op: str, **kwargs) -> dict:
        self.conn.send_bytes(json.dumps({"op": op, **kwargs}).encode())
        return self._recv()

    def close(self) -> None:
        try:
            self.conn.send_bytes(json.dumps({"op": "stop"}).encode())
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.conn.close()


def transfer_time(peer: Peer, backend: str, sender: Any, layer: torch.Tensor, layers: int, tokens: int) -> float:
    from kv_transfer import TransferTicket

    r = peer.call("reserve", backend=backend, tokens=tokens)
    if r["ticket"] is None:
        raise RuntimeError("decode cache too small for the prompt")
    ticket = TransferTicket(**r["ticket"])
    start = time.perf_counter()
    for i in range(layers):
        sender.send_layer(ticket, i, layer)
    sender.commit(ticket, 7, None)
    elapsed = time.perf_counter() - start
    peer.call("abort", backend=backend, rid=r["rid"])
    return elapsed
