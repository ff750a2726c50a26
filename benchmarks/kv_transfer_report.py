"""The transfer benchmark's report: per layout and prompt length the limits and every backend in
GB/s, each backend against the socket, and the overlap measurement; the rows get their rates."""

from __future__ import annotations

import torch


def print_report(rows: list[dict], notes: list[str], ov: dict | None, backends: list[str], repeats: int) -> None:
    """Print the tables; adds each row's rates (GB/s) and ratios, as the JSON has them."""
    gbs = lambda nb, s: nb / s / 1e9 if s else None  # noqa: E731
    print(f"\nKV transfer, median of {repeats} (GB/s = 1e9 bytes/s; torch threads {torch.get_num_threads()})")
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
    for layout in dict.fromkeys(r["layout"] for r in rows):
        r = next(r for r in rows if r["layout"] == layout)
        if r.get("bytes_per_token"):
            print(f"KV bytes per token, {layout}: {r['bytes_per_token']} as {r['kv_cache_dtype']} pages, "
                  f"{r['model_dtype_bytes_per_token']} in the model's dtype "
                  f"({r['bytes_per_token'] / r['model_dtype_bytes_per_token']:.2f}x)")
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
