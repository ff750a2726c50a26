"""Experiment: this cluster against `transformers serve --continuous-batching --device cpu`, same checkpoint,
same client, same requests.

    python scripts/exp_vs_transformers_serve.py          # ~10 min on 2 cores

The checkpoint is a random ~3M-parameter Qwen2-shaped model written with transformers
(`Qwen2Config`: 4 layers, hidden 128, 4 heads, 2 KV heads, MLP 512, vocab 8192) with the built-in
model's tokenizer, saved under the output directory; both systems load it from there.

  pdcluster       `pdcluster up`: one prefill worker pinned to CPU 0, one decode worker pinned to
                  CPU 1, one torch thread each (the default deployment, pinned)
  transformers    `transformers serve --continuous-batching --device cpu --force-model DIR`, the
                  process pinned to CPUs {0, 1} (taskset), torch's default threads

One `pdcluster bench serve` run drives both (interleaved per load point, order alternating): a burst
of 16 requests at once (16 concurrent streams) of ~150-word prompts (200 tokens) and 64 output
tokens, three bursts per system; then the Azure conversation trace at Poisson rates. No
`ignore_eos` (the other server may not take it); outputs end at max_tokens or EOS, and throughput
counts the tokens each server reports in `usage`.

Goal: >= 5x the output throughput of transformers serve at equal or better p99 TPOT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from benchmarks.local_clusters import REPO, interrupt, start, stop, warm_up
from common.net import free_port
from loadgen.cli import main as bench_serve


def make_checkpoint(path: Path) -> Path:
    """A random Qwen2-shaped checkpoint (~3M parameters) with the built-in model's tokenizer."""
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers

    from engine.builtin_model import resolve_model_path

    tok_dir = resolve_model_path("builtin:tiny-llama")
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    for name in ("generation_config.json",):
        if (tok_dir / name).is_file() and not (path / name).is_file():
            shutil.copy(tok_dir / name, path / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"checkpoint {path}: Qwen2, {n / 1e6:.2f}M parameters")
    return path


def start_transformers(ckpt: Path, out: Path, timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (out / "transformers.log").open("w")
    cmd = ["taskset", "-c", "0,1", "transformers", "serve", "--continuous-batching", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", str(ckpt)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            r = httpx.post(f"{url}/v1/completions", timeout=120,
                           json={"model": str(ckpt), "prompt": "warm up", "max_tokens": 4})
            if r.status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    why = f"exited with code {proc.returncode}" if proc.poll() is not None else f"did not answer within {timeout_s:.0f} s"
    stop(proc)
    raise SystemExit(f"transformers serve {why}; see {out / 'transformers.log'} (it needs `pip install "
                     "pdcluster[compare]`: fastapi, uvicorn and accelerate)")


def ratios(result: dict) -> list[dict]:
    """Per load point: ours / theirs output throughput, and both p99 TPOTs."""
    by: dict[tuple, dict] = {}
    for run in result["runs"]:
        rate = float(run["rate"]) if run["rate"] is not None else None  # "inf" in JSON: a burst
        by[(rate, run["label"])] = run["summary"]
    rows = []
    for rate in sorted({k[0] for k in by}, key=lambda r: (r is None, r or 0)):
        ours, theirs = by.get((rate, "pdcluster")), by.get((rate, "transformers"))
        if not ours or not theirs:
            continue
        rows.append({"rate": rate, "ours_out_tok_s": ours["output_throughput"],
                     "theirs_out_tok_s": theirs["output_throughput"],
                     "throughput_ratio": (ours["output_throughput"] / theirs["output_throughput"]
                                          if theirs["output_throughput"] else None),
                     "ours_tpot_p99": ours["tpot_ms"]["p99"], "theirs_tpot_p99": theirs["tpot_ms"]["p99"],
                     "ours_ttft_p50": ours["ttft_ms"]["p50"], "theirs_ttft_p50": theirs["ttft_ms"]["p50"],
                     "ours_tpot_p50": ours["tpot_ms"]["p50"], "theirs_tpot_p50": theirs["tpot_ms"]["p50"],
                     "ours_failed": ours["failed"] + ours["unfinished"],
                     "theirs_failed": theirs["failed"] + theirs["unfinished"]})
    return rows


def table(rows: list[dict], title: str) -> str:
    lines = [f"{title}", "", "| load | pdcluster out tok/s | transformers out tok/s | ratio | TTFT p50 ms (ours / theirs) "
             "| TPOT p50 ms (ours / theirs) | TPOT p99 ms (ours / theirs) | failed+unfinished (ours / theirs) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        load = "burst of 16" if r["rate"] is None or r["rate"] == float("inf") else f"{r['rate']:g} req/s"
        ratio = f"**{r['throughput_ratio']:.1f}x**" if r["throughput_ratio"] else "-"
        lines.append(f"| {load} | {r['ours_out_tok_s']:.1f} | {r['theirs_out_tok_s']:.1f} | {ratio} | "
                     f"{r['ours_ttft_p50']:.0f} / {r['theirs_ttft_p50']:.0f} | {r['ours_tpot_p50']:.1f} / "
                     f"{r['theirs_tpot_p50']:.1f} | {r['ours_tpot_p99']:.1f} / {r['theirs_tpot_p99']:.1f} | "
                     f"{r['ours_failed']} / {r['theirs_failed']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bursts", type=int, default=3, help="bursts of 16 concurrent requests per system")
    p.add_argument("--rates", default="0.5,1,2", help="Azure conversation trace at these Poisson rates ('' to skip)")
    p.add_argument("--num-requests", type=int, default=48, help="per rate")
    p.add_argument("--time-limit-s", type=float, default=240.0)
    p.add_argument("--out", default="bench_results/exp_vs_transformers_serve")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)  # stop the clusters on a kill too (see the finally below)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(out / "qwen2-3m")
    from pdcluster.cluster_config import load_cluster_config

    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    cfg["model"] = {**cfg["model"], "path": str(ckpt), "max_model_len": 2048}
    cfg["router"] = {**cfg["router"], "grpc_port": 0, "http_port": 0}
    cfg["engine"] = {**cfg.get("engine", {}), "num_threads": 1}
    usable = sorted(os.sched_getaffinity(0))
    cfg["pools"] = [{"name": "prefill", "role": "prefill", "replicas": 1, "resources": {"num_cpus": 1}, "cpus": [usable[0]]},
                    {"name": "decode", "role": "decode", "replicas": 1, "resources": {"num_cpus": 1}, "cpus": [usable[-1]]}]
    (out / "pdcluster.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    load_cluster_config(out / "pdcluster.yaml")  # refuse a bad file here, not in the subprocess
    procs = []
    results = {}
    try:
        ours, ours_url = start("pdcluster", out / "pdcluster.yaml", out)
        procs.append(ours)
        theirs, theirs_url = start_transformers(ckpt, out)
        procs.append(theirs)
        model = str(ckpt)
        warm_up(ours_url, model)
        warm_up(theirs_url, model)
        common = ["--endpoint", ours_url, "--endpoint-label", "pdcluster", "--endpoint", theirs_url,
                  "--endpoint-label", "transformers", "--model", model, "--tokenizer", str(ckpt),
                  "--time-limit-s", str(args.time_limit_s), "--request-timeout-s", str(args.time_limit_s)]
        for i in range(args.bursts):  # a burst of 16 at once per system, interleaved, `bursts` times
            burst = common + ["--workload", "synthetic", "--synthetic-input", "fixed:200", "--synthetic-output",
                              "fixed:64", "--num-requests", "16", "--rate", "inf", "--seed", str(i),
                              "--out", str(out / f"burst16-{i}")]
            print("pdcluster bench serve " + " ".join(burst), flush=True)
            if bench_serve(burst) != 0:
                return 1
            results[f"burst16-{i}"] = json.loads((out / f"burst16-{i}" / "result.json").read_text())
        if args.rates:
            trace = common + ["--workload", "azure-conv", "--num-requests", str(args.num_requests),
                              "--rates", args.rates, "--max-context", "1024", "--max-output", "128",
                              "--out", str(out / "azure")]
            print("pdcluster bench serve " + " ".join(trace), flush=True)
            if bench_serve(trace) != 0:
                return 1
            results["azure"] = json.loads((out / "azure" / "result.json").read_text())
    finally:
        for proc in procs:
            stop(proc)
    text = ""
    summary = {name: ratios(res) for name, res in results.items()}
    bursts = [rows[0] for name, rows in summary.items() if name.startswith("burst16") and rows]
    if bursts:
        text += table(bursts, "16 concurrent streams, 200-token prompts, 64 output tokens (one row per burst)")
        ok = [b["throughput_ratio"] for b in bursts if b["throughput_ratio"]]
        if ok:
            med = statistics.median(ok)
            summary["burst16_median_ratio"] = med
            text += f"\nmedian output-throughput ratio over {len(ok)} bursts: **{med:.1f}x**\n\n"
    if "azure" in summary:
        text += table(summary["azure"], "Azure conversation trace (lengths scaled to 1024), Poisson arrivals") + "\n"
    (out / "exp_summary.json").write_text(json.dumps(summary, indent=2))
    (out / "exp_summary.md").write_text(text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
