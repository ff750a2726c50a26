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
import json
import os
import sys
import tempfile
from pathlib import Path
from statistics import median

import torch

from benchmarks.kv_transfer_layouts import BACKENDS, LAYOUTS, Layout
from benchmarks.kv_transfer_limits import grpc_raw_time, memcpy_time, socket_time
from benchmarks.kv_transfer_overlap import overlap
from benchmarks.kv_transfer_peer import Peer, transfer_time
from benchmarks.kv_transfer_report import print_report

SKIP_ESTIMATE_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster bench transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,2048,8192", help="prompt lengths (comma-separated)")
    p.add_argument("--layouts", default="builtin,llama3-8b", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
                   help="the decode worker's KV pages: the layout's dtype, or quantized pages (they travel as stored)")
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
    layouts = [Layout(n, *LAYOUTS[n], kv_cache_dtype=args.kv_cache_dtype) for n in args.layouts.split(",") if n]
    backends = [b for b in args.backends.split(",") if b]
    os.environ.setdefault("PDCLUSTER_CACHE", os.path.join(tempfile.gettempdir(), "pdcluster-cache"))
    rows: list[dict] = []
    notes: list[str] = []
    n_cases = len(layouts) * len(tokens) + (1 if args.overlap_tokens else 0)
    bar = tqdm(total=n_cases, desc="bench transfer", unit="case")
    rate: dict[tuple[str, str], float] = {}  # (layout, backend) -> bytes/s seen so far, for estimates
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-") as tmp:
        for lay in layouts:
            peer = Peer(lay, max(tokens), Path(tmp), args.threads)
            try:
                for n in sorted(tokens):
                    bar.set_postfix_str(f"{lay.name} {n} tok")
                    nbytes = lay.nbytes(n)
                    layer = lay.random_layer(n)
                    row = {"layout": lay.name, "tokens": n, "bytes": nbytes, "kv_cache_dtype": lay.kv_cache_dtype,
                           "bytes_per_token": lay.bytes_per_token(),
                           "model_dtype_bytes_per_token": lay.model_dtype_bytes_per_token(),
                           "socket_s": median([socket_time(layer, lay.layers, peer) for _ in range(args.repeats)]),
                           "memcpy_s": median([memcpy_time(layer, lay.layers) for _ in range(args.repeats)]),
                           "grpc_raw_s": median([grpc_raw_time(layer, lay.layers, peer.raw_port)
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
                        row[f"{b}_s"] = median(ts)
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

    print_report(rows, notes, ov, backends, args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "torch_threads": torch.get_num_threads(), "rows": rows,
                               "notes": notes, "overlap": ov}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
