"""KV transfer benchmark: the grpc, shm, torch_distributed and tcp backends against the machine's limits, and layer-wise overlap.

Run as `pdcluster bench transfer [options]` or `python scripts/bench_transfer.py [options]`.

The receiving side runs in a second process, as a decode worker does (its own interpreter and
GIL); the sending side, the memcpy limit and the overlap measurement run in this one.

Transfers (per layout x prompt length x backend)
    A real `DecodeEngine` per backend (its receiver on its own gRPC server on 127.0.0.1) over a
    tiny random Llama checkpoint written with transformers whose KV cache has the layout's shape,
    in the receiving process. A ticket is reserved with `DecodeEngine.reserve` for a dummy prompt
    of the length (asked for over a pipe, untimed); the prefill side (`create_sender(backend, compat_hash)`, default options) then pushes
    one random layer tensor (2, blocks, block_size, kv_heads, head_dim) with `send_layer` for every
    layer, then `commit`. Timed: first `send_layer` to `commit` returned (the receiver has written
    every layer into the reserved blocks). One untimed warm-up transfer per case.
    Bytes = 2 * layers * blocks * block_size * kv_heads * head_dim * itemsize (whole blocks).

Limits, same bytes
    socket   plain TCP on 127.0.0.1 between the two processes: the receiving one `recv_into`s a
             preallocated bytearray, this one `sendall`s each layer's bytes (no copy, no framing),
             then waits for a 1-byte ack.
    grpc-raw the ceiling of any design on grpc-python: the same bytes as one client stream of `bytes`
             messages (one per layer, at most 8 MiB each, as the grpc backend splits them) with
             identity serializers, no checksum, no protobuf, into a generic handler in the
             receiving process that only counts them.
    memcpy   `torch.Tensor.copy_` of each layer into a preallocated destination.

Overlap (built-in model, `--overlap-tokens` prompt, `--overlap-backend` (grpc), TTFT = `PrefillEngine.step()` incl. commit)
    a) normal     layers are sent from the layer hook during the forward pass (background stream)
    b) sync       the same, but after every `send_layer` wait for the receiver's ack (`flush`)
    c) compute    a sender whose send_layer / commit do nothing
    hidden = 1 - (a - c) / (b - c): the fraction of the (synchronous) transfer time hidden; also
    paired by round, 1 - median(a_i - c_i) / median(b_i - c_i), which cancels drift between rounds.

Transfers: medians over `--repeats`. Overlap: `--overlap-repeats` interleaved rounds (a, b, c) after a
warm-up round, median and min (the effect is small next to CPU noise on a shared machine). JSON: `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch

LAYOUTS = {
    # name: (layers, kv heads, head dim, dtype)
    "builtin": (6, 4, 48, "float32"),
    "llama3-8b": (32, 8, 128, "bfloat16"),
}
BLOCK_SIZE = 16
BACKENDS = ("grpc", "shm", "torch_distributed", "tcp")
SKIP_ESTIMATE_S = 60.0


@dataclass
class Layout:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def layer_shape(self, tokens: int) -> tuple[int, ...]:
        return (2, -(-tokens // BLOCK_SIZE), BLOCK_SIZE, self.kv_heads, self.head_dim)

    def nbytes(self, tokens: int) -> int:
        n = 1
        for d in self.layer_shape(tokens):
            n *= d
        return n * self.layers * getattr(torch, self.dtype).itemsize


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


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# ------------------------------------------------------------------------------- limits
def socket_time(layer: torch.Tensor, layers: int, peer: _Peer) -> float:
    """Seconds to move `layers` copies of `layer`'s bytes over loopback TCP into the receiving
    process's preallocated buffer."""
    view = memoryview(layer.contiguous().view(-1).view(torch.uint8).numpy())
    port = peer.call("socket", total=len(view) * layers)["port"]
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(layers):
            c.sendall(view)
        c.recv(1)
    elapsed = time.perf_counter() - start
    peer.call("socket_done")
    return elapsed


def grpc_raw_time(layer: torch.Tensor, layers: int, port: int) -> float:
    """Seconds to client-stream `layers` copies of `layer`'s bytes (in <= 8 MiB messages) to the
    receiving process's counting handler: grpc-python's own ceiling, nothing of ours on the path."""
    import grpc

    data = layer.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    step = 8 << 20
    parts = [data[i : i + step] for i in range(0, len(data), step)] * layers
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=_RAW_OPTIONS) as channel:
        call = channel.stream_unary("/pdcluster.bench.Raw/Count")
        start = time.perf_counter()
        got = int.from_bytes(call(iter(parts), timeout=600), "little")
        elapsed = time.perf_counter() - start
    if got != len(data) * layers:
        raise RuntimeError(f"grpc-raw: {got} bytes arrived of {len(data) * layers}")
    return elapsed


_RAW_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _grpc_raw_sink() -> Any:
    """Receiving process: a gRPC server whose one method counts the bytes of a client stream."""
    from concurrent import futures

    import grpc

    def count(messages: Any, context: Any) -> bytes:
        return sum(len(m) for m in messages).to_bytes(8, "little")

    server = grpc.server(futures.ThreadPoolExecutor(2), options=_RAW_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "pdcluster.bench.Raw", {"Count": grpc.stream_unary_rpc_method_handler(count)})])
    server.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server


def _socket_sink(total: int) -> tuple[socket.socket, threading.Thread]:
    """Receiving process: a listening socket and a thread that takes `total` bytes, then acks."""
    sink = bytearray(total)
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            buf, got = memoryview(sink), 0
            while got < total:
                n = conn.recv_into(buf[got:], total - got)
                if n == 0:
                    break
                got += n
            conn.sendall(b"\x01")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def memcpy_time(layer: torch.Tensor, layers: int) -> float:
    dst = [torch.zeros_like(layer) for _ in range(layers)]  # touched: no page faults in the timing
    start = time.perf_counter()
    for d in dst:
        d.copy_(layer)
    return time.perf_counter() - start


# ------------------------------------------------------------------------------- transfers
class _Receiver:
    """One decode Engine for a layout; a DecodeEngine per backend over it (reserved serially)."""

    def __init__(self, lay: Layout, max_tokens: int, workdir: Path) -> None:
        from decode_worker import DecodeEngine
        from engine import Engine, EngineConfig

        path = _write_checkpoint(workdir / lay.name, lay, max_tokens + BLOCK_SIZE)
        blocks = -(-max_tokens // BLOCK_SIZE) + 2
        cfg = EngineConfig(model=str(path), dtype=lay.dtype, device="cpu", num_blocks=blocks,
                           max_model_len=max_tokens + BLOCK_SIZE, enable_prefix_caching=False)
        self.engine = Engine(cfg, "decode")
        self.decoders = {b: DecodeEngine(self.engine, backend=b) for b in BACKENDS}

    def close(self) -> None:
        for d in self.decoders.values():
            d.close()


def _receiving_process(conn: Connection, lay: dict, max_tokens: int, workdir: str, threads: int | None) -> None:
    """The receiving process: a `_Receiver` for one layout, driven by JSON requests over `conn`."""
    from engine import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    recv = _Receiver(Layout(**lay), max_tokens, Path(workdir))
    sockets: list[tuple[socket.socket, threading.Thread]] = []
    raw = _grpc_raw_sink()
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
                sockets.append(_socket_sink(req["total"]))
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


class _Peer:
    """This process's end of the receiving process."""

    def __init__(self, lay: Layout, max_tokens: int, workdir: Path, threads: int | None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiving_process, daemon=True, name=f"bench-receiver-{lay.name}",
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


def transfer_time(peer: _Peer, backend: str, sender, layer: torch.Tensor, layers: int, tokens: int) -> float:
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


# ------------------------------------------------------------------------------- overlap
def overlap(tokens: int, repeats: int, backend: str = "grpc") -> dict:
    from decode_worker import DecodeEngine
    from engine import Engine, EngineConfig, SamplingParams
    from kv_transfer import KVSender, create_sender
    from prefill_worker.prefill_engine import PrefillEngine

    class NullSender(KVSender):
        def send_layer(self, ticket, layer, kv):
            pass

        def commit(self, ticket, first_token, logprob):
            pass

        def abort(self, ticket, reason):
            pass

    class SyncSender(KVSender):
        """The backend's sender, but each layer is acknowledged before the forward pass goes on."""

        def __init__(self, inner) -> None:
            super().__init__(inner.compat_hash)
            self.inner = inner

        def send_layer(self, ticket, layer, kv):
            self.inner.send_layer(ticket, layer, kv)
            self.inner.flush(ticket)

        def commit(self, ticket, first_token, logprob):
            self.inner.commit(ticket, first_token, logprob)

        def abort(self, ticket, reason):
            self.inner.abort(ticket, reason)

    blocks = -(-tokens // BLOCK_SIZE) + 2
    cfg = EngineConfig(model="builtin:tiny-llama", device="cpu", num_blocks=blocks, max_model_len=tokens + BLOCK_SIZE,
                       max_num_batched_tokens=max(2048, tokens), enable_prefix_caching=False)
    decode = DecodeEngine(Engine(cfg, "decode"), backend=backend)
    pre_engine = Engine(cfg, "prefill")
    inner = create_sender(backend, decode.compat_hash, timeout_s=120.0)
    senders = {"normal": inner, "sync": SyncSender(inner),
               "compute": NullSender(decode.compat_hash)}
    g = torch.Generator().manual_seed(0)
    vocab = pre_engine.model_cfg.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {k: [] for k in senders}
    commit_ms: dict[str, list[float]] = {k: [] for k in senders}
    try:
        for rep in range(repeats + 1):  # the first round is a warm-up
            for mode, sender in senders.items():
                prefill = PrefillEngine(pre_engine, sender)
                prompt = torch.randint(4, vocab, (tokens,), generator=g).tolist()
                rid = uuid.uuid4().hex
                ticket = decode.reserve(rid, prompt, params)
                prefill.add(rid, prompt, params, ticket)
                start = time.perf_counter()
                results = []
                while prefill.has_work():
                    results.extend(prefill.step())
                elapsed = time.perf_counter() - start
                if len(results) != 1 or results[0].error:
                    raise RuntimeError(f"overlap {mode}: {results}")
                decode.abort_request(rid)
                if rep:
                    times[mode].append(elapsed)
                    commit_ms[mode].append(results[0].commit_ms)
    finally:
        inner.close()
        decode.close()
    def hidden(stat: Callable[[list[float]], float]) -> float | None:
        a, b, c = (stat(times[k]) for k in ("normal", "sync", "compute"))
        return 1 - (a - c) / (b - c) if b > c else None

    # paired by round (a round runs a, b, c back to back): drift of the machine between rounds cancels
    da = [x - z for x, z in zip(times["normal"], times["compute"])]
    db = [y - z for y, z in zip(times["sync"], times["compute"])]
    paired = 1 - _median(da) / _median(db) if _median(db) > 0 else None
    lay = Layout("builtin", *LAYOUTS["builtin"])
    return {
        "tokens": tokens, "bytes": lay.nbytes(tokens), "repeats": repeats, "backend": backend,
        "ttft_s": {k: _median(v) for k, v in times.items()},
        "ttft_min_s": {k: min(v) for k, v in times.items()}, "ttft_all_s": times,
        "commit_ms": {k: _median(v) for k, v in commit_ms.items()},
        "hidden_fraction": hidden(_median), "hidden_fraction_min": hidden(min), "hidden_fraction_paired": paired,
    }


# ------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster bench transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,2048,8192", help="prompt lengths (comma-separated)")
    p.add_argument("--layouts", default="builtin,llama3-8b", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--overlap-tokens", type=int, default=2048, help="0: skip the overlap measurement")
    p.add_argument("--overlap-backend", default="grpc", choices=BACKENDS, help="the backend the overlap is measured with")
    p.add_argument("--overlap-repeats", type=int, default=7,
                   help="rounds of (a, b, c), interleaved, after one warm-up round (the effect is small vs noise)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-skip", action="store_true", help=f"run cases estimated over {SKIP_ESTIMATE_S:.0f} s too")
    p.add_argument("--out", default="bench_results/bench_transfer.json")
    return p


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from kv_transfer import create_sender

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.overlap_tokens and args.overlap_repeats < 1:
        parser.error("--overlap-repeats must be >= 1 (--overlap-tokens 0 skips the overlap measurement)")
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    layouts = [Layout(n, *LAYOUTS[n]) for n in args.layouts.split(",") if n]
    backends = [b for b in args.backends.split(",") if b]
    os.environ.setdefault("PDCLUSTER_CACHE", os.path.join(tempfile.gettempdir(), "pdcluster-cache"))
    rows: list[dict] = []
    notes: list[str] = []
    n_cases = len(layouts) * len(tokens) + (1 if args.overlap_tokens else 0)
    bar = tqdm(total=n_cases, desc="bench transfer", unit="case")
    rate: dict[tuple[str, str], float] = {}  # (layout, backend) -> bytes/s seen so far, for estimates
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-") as tmp:
        for lay in layouts:
            peer = _Peer(lay, max(tokens), Path(tmp), args.threads)
            try:
                for n in sorted(tokens):
                    bar.set_postfix_str(f"{lay.name} {n} tok")
                    nbytes = lay.nbytes(n)
                    layer = torch.randn(lay.layer_shape(n)).to(getattr(torch, lay.dtype))
                    row = {"layout": lay.name, "tokens": n, "bytes": nbytes,
                           "socket_s": _median([socket_time(layer, lay.layers, peer) for _ in range(args.repeats)]),
                           "memcpy_s": _median([memcpy_time(layer, lay.layers) for _ in range(args.repeats)]),
                           "grpc_raw_s": _median([grpc_raw_time(layer, lay.layers, peer.raw_port)
                                                  for _ in range(args.repeats)])}
                    for b in backends:
                        sender = create_sender(b, peer.hashes[b], timeout_s=300.0)
                        try:
                            # warm-up, per case (a fresh sender): connection, handshake, shm segments
                            # sized for this prompt length, as a serving worker has them after one request
                            transfer_time(peer, b, sender, layer, lay.layers, n)
                            est = nbytes / rate[(lay.name, b)] * args.repeats if (lay.name, b) in rate else 0.0
                            if est > SKIP_ESTIMATE_S and not args.no_skip:
                                notes.append(f"skipped {b} {lay.name} {n} tokens: estimated {est:.0f} s "
                                             f"for {args.repeats} repeats (--no-skip runs it)")
                                row[f"{b}_s"] = None
                                continue
                            ts = [transfer_time(peer, b, sender, layer, lay.layers, n) for _ in range(args.repeats)]
                        finally:
                            sender.close()
                        row[f"{b}_s"] = _median(ts)
                        row[f"{b}_all_s"] = ts
                        rate[(lay.name, b)] = nbytes / row[f"{b}_s"]
                    rows.append(row)
                    del layer
                    bar.update()
            finally:
                peer.close()
        ov = None
        if args.overlap_tokens:
            bar.set_postfix_str(f"overlap {args.overlap_tokens} tok")
            ov = overlap(args.overlap_tokens, args.overlap_repeats, args.overlap_backend)
            bar.update()
    bar.close()

    gbs = lambda nb, s: nb / s / 1e9 if s else None  # noqa: E731
    print(f"\nKV transfer, median of {args.repeats} (GB/s = 1e9 bytes/s; torch threads {torch.get_num_threads()})")
    hdr = f"{'layout':<10} {'tokens':>6} {'MiB':>7} | {'socket':>7} {'grpc-raw':>8} {'memcpy':>7} | " + " ".join(
        f"{b + ' s':>8} {b:>6}" for b in backends) + " | " + " ".join(f"{b + '/sock':>9}" for b in backends)
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        nb = r["bytes"]
        r["socket_gbs"], r["memcpy_gbs"] = gbs(nb, r["socket_s"]), gbs(nb, r["memcpy_s"])
        r["grpc_raw_gbs"] = gbs(nb, r["grpc_raw_s"])
        if r.get("grpc_s"):
            r["grpc_over_grpc_raw"] = r["grpc_raw_s"] / r["grpc_s"]
        cells = []
        ratios = []
        for b in backends:
            s = r.get(f"{b}_s")
            r[f"{b}_gbs"] = gbs(nb, s)
            r[f"{b}_over_socket"] = r["socket_s"] / s if s else None
            cells.append(f"{s:8.3f} {r[f'{b}_gbs']:6.2f}" if s else f"{'skipped':>8} {'-':>6}")
            ratios.append(f"{r[f'{b}_over_socket']:9.2f}" if s else f"{'-':>9}")
        print(f"{r['layout']:<10} {r['tokens']:>6} {nb / 2**20:7.1f} | {r['socket_gbs']:7.2f} "
              f"{r['grpc_raw_gbs']:8.2f} {r['memcpy_gbs']:7.2f} | " + " ".join(cells) + " | " + " ".join(ratios))
    print("(socket / grpc-raw / memcpy / backend columns: GB/s; '<backend> s': seconds; <backend>/sock: bytes/s "
          "ratio)")
    for note in notes:
        print("note:", note)
    if ov:
        t = ov["ttft_s"]
        print(f"\nlayer-wise overlap, built-in model, {ov['tokens']}-token prompt, {ov['backend']} "
              f"({ov['bytes'] / 2**20:.1f} MiB of KV), TTFT over {ov['repeats']} rounds:")
        print(f"  {'':<40} {'median':>9} {'min':>9}   commit (median)")
        for k, label in (("normal", "a) streamed during the forward pass"), ("sync", "b) each layer acked before going on"),
                         ("compute", "c) no transfer (compute only)")):
            print(f"  {label:<40} {t[k] * 1e3:6.1f} ms {ov['ttft_min_s'][k] * 1e3:6.1f} ms   "
                  f"{ov['commit_ms'][k]:.1f} ms")
        fmt = lambda h: f"{h:.2f}" if h is not None else "n/a (b <= c: noise larger than the transfer)"  # noqa: E731
        print(f"  transfer time hidden, 1 - (a-c)/(b-c): medians {fmt(ov['hidden_fraction'])}, "
              f"mins {fmt(ov['hidden_fraction_min'])}; paired by round, 1 - median(a-c)/median(b-c): "
              f"{fmt(ov['hidden_fraction_paired'])}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "torch_threads": torch.get_num_threads(), "rows": rows,
                               "notes": notes, "overlap": ov}, indent=2))
    print(f"\nwrote {out}")
    return 0
