"""The `pdcluster` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _make_model(args: argparse.Namespace) -> int:
    from engine.builtin_model import write_builtin_model

    path = write_builtin_model(args.out, args.name)
    print(f"wrote builtin:{args.name} to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pdcluster import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    if args.offline:
        return _generate_offline(args, params)
    import grpc

    from pdcluster.client import Client

    address = args.address or _default_address()
    status = 0
    with Client(address, api_key=args.api_key) as client:
        for prompt in args.prompts:
            try:
                if args.json:
                    c = client.complete(prompt, params)
                    print(json.dumps({"request_id": c.request_id, "token_ids": c.token_ids, "text": c.text,
                                      "finish_reason": c.finish_reason, "usage": {"prompt_tokens": c.prompt_tokens,
                                      "completion_tokens": c.completion_tokens}, "timing": c.timing}))
                    continue
                for chunk in client.stream(prompt, params):
                    print(chunk.text, end="", flush=True)
                    if chunk.finish_reason:
                        t = chunk.timing
                        print(f"\n--- finish_reason={chunk.finish_reason} tokens={chunk.usage.completion_tokens} "
                              f"ttft={t.ttft_ms:.1f}ms tpot={t.mean_tpot_ms:.1f}ms", file=sys.stderr)
            except grpc.RpcError as e:
                print(f"pdcluster: {e.code().name}: {e.details()}", file=sys.stderr)
                status = 1
    return status


def _default_address() -> str:
    from pdcluster.client import DEFAULT_ADDRESS
    from pdcluster.launcher import _read_state

    state = _read_state()
    return (state or {}).get("router") or DEFAULT_ADDRESS


def _generate_offline(args: argparse.Namespace, params) -> int:
    from pdcluster import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    start = time.perf_counter()
    outs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    elapsed = time.perf_counter() - start
    for out in outs:
        print(f"--- {out.prompt!r} -> {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
        print(out.text)
    n = sum(len(o.token_ids) for o in outs)
    print(f"--- {len(outs)} requests, {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s), "
          f"prefill -> in-process KV transfer -> decode", file=sys.stderr)
    return 0


def _up(args: argparse.Namespace) -> int:
    from pdcluster.cluster_config import load_cluster_config
    from pdcluster.launcher import up

    cfg = load_cluster_config(args.config)
    handle = up(cfg, detach=args.detach, log_level=args.log_level, log_format=args.log_format)
    print(f"pdcluster is up ({cfg.mode}, model {cfg.model.path})")
    print(f"  router gRPC   {handle.router_address}")
    print(f"  OpenAI API at http://{handle.http_address}/v1")
    for w in handle.workers:
        print(f"  {w['role']:<9} {w['worker_id']:<16} {w['address']}  (pool {w['pool']}, pid {w['pid']})")
    if args.detach:
        print("detached: `pdcluster status`, `pdcluster generate \"...\"`, `pdcluster down`")
        return 0
    print("serving; Ctrl-C stops the cluster")
    import signal

    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, _interrupt)  # also when started with SIGINT ignored (e.g. `cmd &`)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping ...")
    finally:
        handle.stop()
    return 0


def _down(args: argparse.Namespace) -> int:
    from pdcluster.launcher import down

    down(args.address)
    print("pdcluster stopped")
    return 0


def _scale(args: argparse.Namespace) -> int:
    from pdcluster.launcher import scale

    workers = scale(args.pool, args.replicas, args.address, drain_timeout_s=args.drain_timeout)
    print(f"pool {args.pool}: {len(workers)} worker(s): {', '.join(w['worker_id'] for w in workers) or '-'}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from pdcluster.launcher import status

    info = status(args.address)
    meta = info.get("meta", {})
    print(f"pdcluster: mode {meta.get('mode')}, model {meta.get('model')}, "
          f"router {(info.get('router') or {}).get('address')}")
    if meta.get("http_address"):
        print(f"OpenAI API at http://{meta['http_address']}/v1")
    if meta.get("controller") is not None:
        print(controller_line(meta["controller"]))
    header = (f"{'pool':<10} {'worker':<16} {'role':<9} {'state':<12} {'running':>7} {'queued':>6} "
              f"{'kv used/free':>14} {'prefix hits':>18}  ranks (pids)")
    print(header)
    for w in sorted(info["workers"], key=lambda w: (w.get("pool", ""), w["worker_id"])):
        kv = f"{w.get('kv_blocks_used', '-')}/{w.get('kv_blocks_free', '-')}"
        ranks = w.get("ranks") or [w.get("pid")]
        print(f"{w.get('pool', ''):<10} {w['worker_id']:<16} {w['role']:<9} {w['state']:<12} "
              f"{w.get('running', '-'):>7} {w.get('queued', '-'):>6} {kv:>14} {hit_rate(w):>18}  "
              f"{len(ranks)} ({', '.join(map(str, ranks))})")
    kinds = sorted({w["kv"] for w in info["workers"] if w.get("kv")})
    for kv in kinds:  # one line per kind of cache (one for a cluster of one model)
        print(f"KV per token: {kv}")
    for line in tier_lines(info["workers"]):
        print(line)
    return 0


def controller_line(c: dict) -> str:
    """The SLO controller's target and its last decision (pdcluster/ray_fleet.py records them)."""
    if not c.get("last"):
        return "SLO controller: on, no decision yet (holding the workers as they are)"
    t, last = c["target"], c["last"]
    ago = time.time() - last["at"]
    return (f"SLO controller: target {t['prefill']} prefill + {t['decode']} decode; last decision {ago:.0f} s ago: "
            f"{last['action']} ({last['reason']}; pressure prefill {last['pressure']['prefill']:.2f}, "
            f"decode {last['pressure']['decode']:.2f})")


def tier_lines(workers: list[dict]) -> list[str]:
    """One line per offload tier (a node's, shared by its workers): its fill, and the hit rate of
    its users' lookups, in LRU order of eviction."""
    tiers: dict[str, list[dict]] = {}
    for w in workers:
        if w.get("tier_id"):
            tiers.setdefault(w["tier_id"], []).append(w)
    lines = []
    for tier_id, users in sorted(tiers.items()):
        first = max(users, key=lambda w: w["tier_used_bytes"])  # the freshest view of the shared directory
        hits, misses = sum(w["tier_hits"] for w in users), sum(w["tier_misses"] for w in users)
        rate = f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"
        lines.append(f"KV offload tier {tier_id}: {first['tier_used_bytes'] / 2**20:.1f} of "
                     f"{first['tier_capacity_bytes'] / 2**20:.0f} MiB, {first['tier_blocks']} blocks; "
                     f"saves {sum(w['tier_saves'] for w in users)}, hits {hits} ({rate} of lookups), "
                     f"evictions {sum(w['tier_evictions'] for w in users)} (LRU); "
                     f"workers {', '.join(sorted(w['worker_id'] for w in users))}")
    return lines


def hit_rate(w: dict) -> str:
    """Prompt tokens served from the worker's prefix cache, of all it served: "37.5% of 4096"."""
    total = w.get("prompt_tokens")
    if total is None:
        return "-"
    return f"{100 * w.get('prefix_cache_hit_tokens', 0) / total:.1f}% of {total}" if total else "0 tokens"


def _bench(args: argparse.Namespace) -> int:
    if args.what == "transfer":
        from benchmarks.kv_transfer import main as bench_transfer

        return bench_transfer(args.rest)
    if args.what == "serve":
        from loadgen.cli import main as bench_serve

        return bench_serve(args.rest)
    raise ValueError(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Prefill-Decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write the built-in random Llama checkpoint (HF format)")
    mm.add_argument("--out", required=True, help="output directory")
    mm.add_argument("--name", default="tiny-llama", help="built-in model name (default: tiny-llama)")
    mm.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="generate through a running cluster (or --offline, in this process)")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--address", default=None, help="router HOST:PORT (default: the detached cluster's, else 127.0.0.1:50051)")
    gen.add_argument("--api-key", default=None, help="API key, if the cluster requires one")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt: ids, text, timing")
    gen.add_argument("--offline", action="store_true", help="no cluster: run prefill and decode engines here")
    gen.add_argument("--model", default="builtin:stdlib-4m", help="--offline: builtin:NAME or a local HF checkpoint dir")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="auto: the checkpoint's own dtype")
    gen.add_argument("--device", default=None, help="--offline: cpu or cuda (default: cuda if available)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)

    upp = sub.add_parser("up", help="start the cluster described by cluster.yaml")
    upp.add_argument("-c", "--config", default="cluster.yaml", help="deployment file (default: cluster.yaml)")
    upp.add_argument("--detach", action="store_true", help="return once the cluster is up; stop it with `down`")
    upp.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    upp.add_argument("--log-format", default="text", choices=["text", "json"],
                     help="worker and router log lines: text, or one JSON object per line (request_id included)")
    upp.set_defaults(func=_up)

    sc = sub.add_parser("scale", help="set the number of workers of a pool (running detached cluster)")
    sc.add_argument("pool", help="pool name from cluster.yaml")
    sc.add_argument("replicas", type=int, help="workers wanted")
    sc.add_argument("--drain-timeout", type=float, default=600.0, help="seconds a removed worker may drain")
    for name, func, text in (("down", _down, "stop a detached cluster"), ("status", _status, "show workers by pool"),
                             ("scale", _scale, None)):
        p = sc if name == "scale" else sub.add_parser(name, help=text)
        p.add_argument("--address", default=None, help="Ray address (default: the detached cluster's)")
        p.set_defaults(func=func)

    bench = sub.add_parser("bench", help="benchmarks (`pdcluster bench transfer --help`, `bench serve --help`)")
    bench.add_argument("what", choices=["transfer", "serve"],
                       help="transfer: KV transfer backends vs socket/memcpy, overlap; "
                            "serve: load generator for any OpenAI-compatible endpoint")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(func=_bench)

    plan = sub.add_parser("plan", add_help=False,
                          help="capacity planner: hardware and prefill:decode ratio for a workload and SLO "
                               "(`pdcluster plan --help`, `plan simulate --help`, `plan calibrate --help`)")
    plan.add_argument("rest", nargs=argparse.REMAINDER, help="the planner's own options")
    plan.set_defaults(func=_plan)
    return parser


def _plan(args: argparse.Namespace) -> int:
    from planner.cli import main as plan_main

    return plan_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # its options go to the planner as they are (argparse would claim --options)
        args = argparse.Namespace(func=_plan, rest=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:  # bad input or a launch failure: a clear message, no traceback
        print(f"pdcluster: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
