"""`pdcluster bench serve`: an open-loop load generator for any OpenAI-compatible endpoint.

Sends streamed `POST /v1/completions` requests (temperature 0, max_tokens = the request's output
length, `ignore_eos` only with --ignore-eos) at open-loop arrival times and measures on the client:
TTFT, TPOT, inter-token latency, end-to-end latency, throughput, SLO attainment and goodput.

Workloads: azure-conv, azure-code, mooncake-conv, mooncake-synthetic (shipped in loadgen/traces;
$PDCLUSTER_WORKLOADS names another directory), any Azure .csv / Mooncake .jsonl file, or `synthetic` (--synthetic-input/-output).
Multi-turn chat: `multiturn` (conversations from --conversations, --turns, --first-prompt-len,
--message-len, --output-len, --think-time) or `multiturn:TRACE` (a Mooncake trace's conversations,
grouped by hash_ids): each turn's prompt is the history plus a new message, sent --think-time after
the previous answer; conversations start at the arrival rate.
Traffic whose mix shifts: `--phases WORKLOAD:RATE:SECONDS,...` (WORKLOAD a name above or
PROMPT/OUTPUT tokens; RATE R or A-B, a ramp) plays the phases back to back, one run per system, and
reports each phase's SLO attainment and, against pdcluster, its worker-seconds per role
(loadgen/phases.py, loadgen/phased_cli.py).
Lengths can be scaled to fit a small model (--max-context C or --scale-lengths F; loadgen/scaling.py,
which scripts/bench_engine.py uses too), and the scaling is always printed.

Several `--endpoint URL --endpoint-label NAME` pairs compare systems: for each rate the systems run
in turn, in alternating order from one rate to the next, on the same requests and arrival times.
Every run is bounded (--time-limit-s, --request-timeout-s, --num-requests). Outputs in --out:
result.json (config, scaling, per-request records, summaries), summary.md, and PNG plots.

Example:
    pdcluster bench serve --endpoint http://127.0.0.1:8000 --workload azure-conv --num-requests 50 \\
        --rates 1,2,4 --max-context 1024 --max-output 64 --slo-ttft-ms 500 --slo-tpot-ms 50 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from common.heap import freeze_startup_heap
from loadgen.arrivals import KINDS, ArrivalConfig, arrival_offsets
from loadgen.client import EndpointConfig, fetch_model
from loadgen.conversation_run import run_conversations
from loadgen.conversations import PREFIX, ConversationConfig, MessageMaker, load_conversations
from loadgen.metrics import SLO, summarize
from loadgen.report import RunReport, failure_lines, run_notes, text_table, write_all
from loadgen.runner import RunResult, run
from loadgen.server_counters import counted
from loadgen.workload import NAMED, SAMPLE_UNITS, Workload, WorkloadConfig, load_workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    e = p.add_argument_group("systems")
    e.add_argument("--endpoint", action="append", required=True, metavar="URL",
                   help="http://HOST:PORT of an OpenAI-compatible server (repeat to compare systems)")
    e.add_argument("--endpoint-label", action="append", default=[], metavar="NAME",
                   help="a name for the matching --endpoint (default: HOST:PORT)")
    e.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    e.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    e.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true (a vLLM extension; pdcluster accepts it): full-length outputs")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="azure-conv",
                   help=f"{', '.join(NAMED)}, synthetic, or a path to an Azure .csv / Mooncake .jsonl trace")
    w.add_argument("--num-requests", type=int, default=100, help="requests per run (the request count limit)")
    w.add_argument("--phases", default=None, metavar="WORKLOAD:RATE:SECONDS,...",
                   help="traffic whose mix shifts, phase by phase (WORKLOAD: a workload name or PROMPT/OUTPUT "
                        "tokens; RATE: R or A-B ramping); reported per phase (loadgen/phases.py)")
    w.add_argument("--sample-seed", type=int, default=None,
                   help="a seeded random sample of trace rows (in trace order) instead of the first rows")
    w.add_argument("--sample-unit", choices=SAMPLE_UNITS, default="rows",
                   help="with --sample-seed: sample rows, or (a Mooncake trace) whole conversations, cut at "
                        "--num-requests rows (keeps each conversation's prefix reuse)")
    w.add_argument("--synthetic-input", default="lognormal:512:0.5",
                   help="synthetic prompt lengths: fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA")
    w.add_argument("--synthetic-output", default="lognormal:128:0.5", help="synthetic output lengths (same)")
    sc = w.add_mutually_exclusive_group()
    sc.add_argument("--max-context", type=int, default=None,
                    help="scale lengths by min(1, C / longest prompt+output): every request fits in C tokens")
    sc.add_argument("--scale-lengths", type=float, default=None, help="scale prompt and output lengths by F")
    w.add_argument("--max-output", type=int, default=None, help="cap output lengths after scaling")
    w.add_argument("--tokenizer", default=None,
                   help="builtin:NAME or a local checkpoint dir: prompts hit their token counts exactly")
    w.add_argument("--seed", type=int, default=0, help="prompt text, synthetic lengths and arrival times")
    w.add_argument("--fresh-prompts", action="store_true",
                   help="each rate gets its own prompt texts (same lengths; every system at that rate the same "
                        "ones), so a run reuses no prefix cached by an earlier run of the sweep")
    m = p.add_argument_group("multi-turn (--workload multiturn or multiturn:TRACE)")
    m.add_argument("--conversations", type=int, default=None, help="conversations per run (default 10)")
    m.add_argument("--turns", default=None, help="turns per conversation: fixed:N | uniform:LO:HI | "
                                                   "lognormal:MEDIAN:SIGMA (default fixed:3; not with a trace)")
    m.add_argument("--first-prompt-len", default=None, help="first prompt tokens (same forms; default fixed:256)")
    m.add_argument("--message-len", default=None, help="tokens of each later turn's new message (default fixed:64)")
    m.add_argument("--output-len", default=None, help="answer tokens, max_tokens (default fixed:64)")
    m.add_argument("--think-time", default=None,
                   help="seconds from an answer to the next turn: fixed:S | uniform:LO:HI | exponential:MEAN | "
                        "trace[:F] (the trace's gap between the two turns times F) (default fixed:1)")
    m.add_argument("--min-turns", type=int, default=None,
                   help="multiturn:TRACE: only conversations of at least K turns (default 2)")
    a = p.add_argument_group("arrivals")
    r = a.add_mutually_exclusive_group()
    r.add_argument("--rate", type=float, default=None, help="requests/s (multi-turn: conversations started per s; inf: all at once)")
    r.add_argument("--rates", default=None, help="a sweep: R1,R2,... requests/s")
    a.add_argument("--arrival", choices=KINDS, default="poisson",
                   help="poisson, gamma (--burstiness), or trace (its timestamps; a rate rescales them)")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular")
    a.add_argument("--time-scale", type=float, default=None,
                   help="--arrival trace: multiply the trace's inter-arrival times by T (0.5: double rate)")
    b = p.add_argument_group("SLO and bounds")
    b.add_argument("--slo-ttft-ms", type=float, default=None, help="SLO: time to first token <= X ms")
    b.add_argument("--slo-tpot-ms", type=float, default=None, help="SLO: time per output token <= Y ms")
    b.add_argument("--time-limit-s", type=float, default=600.0,
                   help="each run stops after T s: in-flight requests are cancelled (unfinished)")
    b.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request timeout")
    p.add_argument("--out", default="bench_results/bench_serve", help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_rates(args: argparse.Namespace) -> list[float | None]:
    if args.rates:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    elif args.rate is not None:
        rates = [args.rate]
    elif args.arrival == "trace":
        return [None]
    else:
        raise ValueError(f"--arrival {args.arrival} needs --rate R or --rates R1,R2,...")
    if any(r <= 0 or math.isnan(r) for r in rates):
        raise ValueError(f"rates must be > 0, got {rates}")
    return list(dict.fromkeys(rates))


def endpoints(args: argparse.Namespace) -> list[EndpointConfig]:
    if len(args.endpoint_label) > len(args.endpoint):
        raise ValueError("more --endpoint-label than --endpoint options")
    labels = args.endpoint_label + [""] * (len(args.endpoint) - len(args.endpoint_label))
    eps = [EndpointConfig(u, lab, args.model, args.api_key, args.ignore_eos, args.request_timeout_s)
           for u, lab in zip(args.endpoint, labels)]
    if len({e.label for e in eps}) < len(eps):
        raise ValueError(f"endpoint labels must differ: {[e.label for e in eps]} (use --endpoint-label)")
    return eps


def load_tokenizer(spec: str | None) -> Any:
    if spec is None:
        return None
    from engine.builtin_model import resolve_model_path
    from engine.tokenizer import load_tokenizer as load

    tok = load(resolve_model_path(spec))
    if tok is None:
        raise ValueError(f"--tokenizer {spec}: the checkpoint has no tokenizer files")
    return tok


_FLAG_TURNS = ("turns", "first_prompt_len", "message_len", "output_len")  # from flags only
_FLAGS_MULTITURN = ("conversations", *_FLAG_TURNS, "think_time", "min_turns")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def conversation_config(args: argparse.Namespace) -> ConversationConfig | None:
    """The multi-turn workload's configuration (None: another workload); refuses flags that do not apply."""
    given = [n for n in _FLAGS_MULTITURN if getattr(args, n) is not None]
    if args.workload != PREFIX and not args.workload.startswith(PREFIX + ":"):
        if given:
            raise ValueError(f"{_flag(given[0])} applies to --workload multiturn or multiturn:TRACE")
        return None
    trace = args.workload != PREFIX
    wrong = [n for n in given if n in _FLAG_TURNS] if trace else [n for n in given if n == "min_turns"]
    if wrong:
        why = "the trace gives the lengths and turn counts" if trace else "it selects conversations of a trace"
        raise ValueError(f"{_flag(wrong[0])} does not apply to --workload {args.workload}: {why}")
    if args.sample_seed is not None:
        raise ValueError("--sample-seed does not apply to a multi-turn workload (the first conversations are used)")
    pick = {n: getattr(args, n) for n in _FLAGS_MULTITURN if getattr(args, n) is not None}
    names = {"first_prompt_len": "first_prompt", "message_len": "message", "output_len": "output",
             "think_time": "think"}
    return ConversationConfig(args.workload, **{names.get(k, k): v for k, v in pick.items()}, seed=args.seed,
                              scale_lengths=args.scale_lengths, max_context=args.max_context,
                              max_output=args.max_output)


def redact(argv: list[str]) -> list[str]:
    """The command line without the API key's value (it goes into result.json and summary.md)."""
    out = list(argv)
    for i, a in enumerate(out):
        if a.startswith("--api-key="):
            out[i] = "--api-key=***"
        elif a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
    return out


def prompt_salt(run: int) -> str:
    """--fresh-prompts: the salt of the prompts of the sweep's run-th rate (the first: none)."""
    return f"rate{run}" if run else ""


def schedule(rates: list[float | None],
             eps: list[EndpointConfig]) -> list[tuple[float | None, EndpointConfig]]:
    """For each rate every system in turn; the order alternates from one rate to the next."""
    return [(rate, e) for i, rate in enumerate(rates) for e in (eps if i % 2 == 0 else eps[::-1])]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args, argv if argv is not None else sys.argv[1:])
    except (ValueError, RuntimeError) as e:  # bad input, an endpoint that does not answer /v1/models
        print(f"pdcluster bench serve: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    from tqdm import tqdm

    if args.phases:
        from loadgen.phased_cli import run_phased

        eps = endpoints(args)
        for e in eps:
            e.model = e.model or asyncio.run(fetch_model(e))
        return run_phased(args, redact(argv), eps, SLO(args.slo_ttft_ms, args.slo_tpot_ms),
                          load_tokenizer(args.tokenizer))
    rates, eps = parse_rates(args), endpoints(args)
    if args.time_scale is not None and args.arrival != "trace":
        raise ValueError("--time-scale applies to --arrival trace")
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    ccfg = conversation_config(args)
    tokenizer = load_tokenizer(args.tokenizer)
    salts = {rate: prompt_salt(k) if args.fresh_prompts else "" for k, rate in enumerate(rates)}
    if ccfg is not None:
        workload: Workload = load_conversations(ccfg, tokenizer, args.tokenizer)
        convs = workload.conversations  # type: ignore[attr-defined]
        starts, unit = [c.arrival_s for c in convs], "conversations"

        def run_one(rate: float | None, e: EndpointConfig, on_done: Any) -> RunResult:
            maker = MessageMaker(args.seed, tokenizer, salts[rate])  # --fresh-prompts: texts of the rate's own
            return run_conversations(convs, arrivals[rate].offsets, e, e.model or "", args.time_limit_s, maker,
                                     on_done, rate, arrivals[rate].description)
    else:
        wcfg = WorkloadConfig(args.workload, args.num_requests, args.sample_seed, args.sample_unit,
                              args.scale_lengths, args.max_context, args.max_output, args.seed,
                              args.synthetic_input, args.synthetic_output)
        workload = load_workload(wcfg, tokenizer, args.tokenizer)
        # per rate: the same requests, or (--fresh-prompts) the same lengths with texts of their own
        requests = {rate: workload.requests if not salts[rate] else load_workload(
            dataclasses.replace(wcfg, prompt_salt=salts[rate]), tokenizer, args.tokenizer).requests
            for rate in rates}
        starts, unit = [r.arrival_s for r in workload.requests], "requests"

        def run_one(rate: float | None, e: EndpointConfig, on_done: Any) -> RunResult:
            return run(requests[rate], arrivals[rate].offsets, e, e.model or "", args.time_limit_s, on_done,
                       rate, arrivals[rate].description)
    reqs = workload.requests
    stamps = starts if args.arrival == "trace" else None
    arrivals = {rate: arrival_offsets(ArrivalConfig(args.arrival, rate, args.burstiness, args.time_scale,
                                                    args.seed), len(starts), stamps) for rate in rates}
    for e in eps:
        e.model = e.model or asyncio.run(fetch_model(e))
    print("\n".join(workload.describe()))
    for rate, arr in arrivals.items():
        print(f"arrivals   {arr.description}: {len(starts)} {unit} over {arr.offsets[-1]:.1f} s "
              f"(mean {arr.mean_rate:.3g} {unit}/s)")
    for e in eps:
        print(f"system     {e.label}: {e.url}/v1/completions, model {e.model!r}"
              f"{', ignore_eos' if e.ignore_eos else ''}")
    print(f"bounds     time limit {args.time_limit_s:g} s per run, "
          f"request timeout {args.request_timeout_s:g} s, "
          f"{len(reqs)} requests per run; SLO: {slo}", flush=True)

    plan = schedule(rates, eps)
    bar = tqdm(total=len(plan) * len(reqs), desc="bench serve", unit="req", disable=args.no_progress)
    reports: list[RunReport] = []
    try:
        for rate, e in plan:
            # the tokenizer, the workloads and the earlier runs' records out of the collector's scans:
            # a full collection over them (150 ms here) stalls every stream the client times
            freeze_startup_heap()
            bar.set_postfix_str(f"{e.label} @ {'trace' if rate is None else f'{rate:g}/s'}")
            result, result_counters = counted(e.url, e.api_key, lambda e=e, rate=rate: run_one(
                rate, e, lambda _rec: bar.update()))
            result.server_counters = result_counters  # what a pdcluster endpoint's workers counted
            left = len(reqs) - sum(1 for r in result.records if r.outcome in ("ok", "failed", "unfinished"))
            bar.update(left)  # not sent: the bar still reaches its end
            rep = RunReport(result, summarize(result.records, result.duration_s, slo))
            reports.append(rep)
            s = rep.summary
            bar.write(f"{rep.name}: {s.completed}/{s.sent} ok in {s.duration_s:.1f} s ({result.stopped_by}), "
                      f"TTFT p50 {s.ttft_ms.p50 or 0:.1f} ms, TPOT p50 {s.tpot_ms.p50 or 0:.1f} ms"
                      + (f", SLO {s.slo_attainment:.0%}" if s.slo_attainment is not None else "")
                      + (f", TTFT p50 turn 1 {s.ttft_first_turn_ms.p50 or 0:.1f} ms, turns 2+ "
                         f"{s.ttft_later_turns_ms.p50 or 0:.1f} ms" if s.ttft_first_turn_ms and s.ttft_later_turns_ms
                         else ""))
    finally:
        bar.close()
    reports.sort(key=lambda r: ([x.label for x in eps].index(r.result.label), rates.index(r.result.rate)))
    print(f"\nresults (client-side; {workload.name}, source: {workload.citation})")
    print(text_table(reports))
    for line in failure_lines(reports):
        print("failures  ", line)
    for note in run_notes(reports):
        print("note:", note)
    config = {**vars(args), "api_key": "(redacted)" if args.api_key else None,
              "command": "pdcluster bench serve " + shlex.join(redact(argv)),
              "arrival": "; ".join(a.description for a in arrivals.values()),
              "models": {e.label: e.model for e in eps}}
    files = write_all(Path(args.out), config, workload, reports)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0 if any(r.summary.completed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
