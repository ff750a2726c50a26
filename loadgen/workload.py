"""Requests (prompt text, output length, arrival offset) from a trace or from synthetic distributions.

Sources
    Azure CSV        `TIMESTAMP,ContextTokens,GeneratedTokens`; wall-clock timestamps become offsets
                     from the first selected row.
    Mooncake JSONL   `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token blocks).
                     Hash ids become shared text: block j of a prompt is the first B words of the word
                     stream of hash_ids[j] (B = the scaled block size), so requests with the same leading
                     ids share that prompt prefix.
    synthetic        prompt and output lengths drawn from fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA.

Selection: the first N rows, or a seeded random sample of N rows kept in trace order (`sample_seed`),
or (`sample_unit="conversations"`, Mooncake) a seeded sample of whole conversations: conversations
drawn at random until they hold N rows, their rows in trace order. A window of the first rows holds
few continued conversations (their turns are minutes apart); sampling conversations keeps each one's
reuse, so a short replay sees the whole trace's share of repeated blocks.
Lengths are then scaled (scaling.py) and prompts built (prompts.py).
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any

from loadgen.prompts import PromptBuilder
from loadgen.scaling import LengthStats, Scaling, block_tokens, choose_factor, scale_lengths

WORKLOADS_DIR = Path(__file__).resolve().parent / "traces"  # shipped with the package (traces/README.md)
WORKLOADS_ENV = "PDCLUSTER_WORKLOADS"  # another directory holding the named traces


def workloads_dir() -> Path:
    """Where the named traces are: $PDCLUSTER_WORKLOADS, else the copies shipped in loadgen/traces."""
    return Path(os.environ[WORKLOADS_ENV]) if os.environ.get(WORKLOADS_ENV) else WORKLOADS_DIR
MOONCAKE_BLOCK = 512
_AZURE = "Azure/AzurePublicDataset, 2023 LLM inference trace, {} service (CC-BY-4.0)"
_MOONCAKE = "kvcache-ai/Mooncake, FAST25-release/traces/{} (Apache-2.0)"
NAMED: dict[str, tuple[str, str]] = {
    "azure-conv": ("AzureLLMInferenceTrace_conv.csv", _AZURE.format("conversation")),
    "azure-code": ("AzureLLMInferenceTrace_code.csv", _AZURE.format("code completion")),
    "mooncake-conv": ("mooncake_conversation_trace.jsonl", _MOONCAKE.format("conversation_trace.jsonl")),
    "mooncake-synthetic": ("mooncake_synthetic_trace.jsonl", _MOONCAKE.format("synthetic_trace.jsonl")),
}


@dataclass
class TraceRow:
    timestamp_s: float  # offset from the trace's first row
    input_len: int
    output_len: int
    hash_ids: list[int] | None = None


@dataclass
class Request:
    index: int
    prompt: str | list[int]  # text, or token ids (multi-turn prompts with a tokenizer)
    prompt_len: int  # target prompt tokens (after scaling)
    output_len: int  # max_tokens (after scaling)
    arrival_s: float | None  # the trace's offset from the first selected row; None: synthetic
    prompt_tokens_measured: int | None = None  # with a tokenizer
    hash_ids: list[int] | None = None


def spec_numbers(spec: str) -> tuple[str, list[float] | None]:
    """A distribution spec "KIND:A:B" -> (KIND, [A, B]); the numbers are None when one does not parse."""
    kind, _, rest = spec.partition(":")
    try:
        return kind, [float(x) for x in rest.split(":") if x]
    except ValueError:
        return kind, None


@dataclass
class LengthDist:
    """fixed:N | uniform:LO:HI (inclusive) | lognormal:MEDIAN:SIGMA (rounded, at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, nums = spec_numbers(spec)
        nums = nums or []
        want = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if want is None or len(nums) != want or nums[0] <= 0 or (kind == "uniform" and nums[1] < nums[0]):
            raise ValueError(f"bad length distribution {spec!r}: "
                             "fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA")
        return cls(kind, *nums)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.lognormvariate(math.log(self.a), self.b)))

    def __str__(self) -> str:
        return f"{self.kind}:{self.a:g}" + (f":{self.b:g}" if self.kind != "fixed" else "")


@dataclass
class WorkloadConfig:
    source: str  # a name in NAMED, "synthetic", or a path to a .csv / .jsonl trace
    num_requests: int
    sample_seed: int | None = None  # None: the first rows
    sample_unit: str = "rows"  # rows | conversations (Mooncake: whole conversations, needs sample_seed)
    scale_lengths: float | None = None
    max_context: int | None = None
    max_output: int | None = None
    seed: int = 0  # prompt text and synthetic lengths
    synthetic_input: str = "fixed:256"
    synthetic_output: str = "fixed:64"
    # salts every prompt's text (not its length): workloads that differ only here share no prefix
    prompt_salt: str = ""


@dataclass
class Workload:
    name: str
    path: str | None
    citation: str
    kind: str  # azure | mooncake | synthetic
    selection: str
    requests: list[Request]
    scaling: Scaling
    tokenizer: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def has_timestamps(self) -> bool:
        return self.kind != "synthetic"

    def describe(self) -> list[str]:
        src = f"{self.name} ({self.path})" if self.path else self.name
        lines = [f"workload   {src}: {len(self.requests)} requests, {self.selection}",
                 f"source     {self.citation}", *self.scaling.lines()]
        measured = [r.prompt_tokens_measured for r in self.requests if r.prompt_tokens_measured is not None]
        if measured:
            off = [(r.prompt_len, m) for m, r in zip(measured, self.requests) if m != r.prompt_len]
            why = (f"; off: {off[:3]}{' ...' if len(off) > 3 else ''} (target, got): "
                   "a text prompt is at least BOS + one word") if off else ""
            exact = f"{len(measured) - len(off)}/{len(measured)}"
            lines.append(f"prompts    tokenized with {self.tokenizer}: {exact} exactly at the target length"
                         + why)
        else:
            lines.append("prompts    no tokenizer: one common word per target token (approximate)")
        return lines + [f"note       {n}" for n in self.notes]


def resolve_source(source: str) -> tuple[str, Path | None, str]:
    """(name, path, citation) for a named workload, 'synthetic', or a file path."""
    if source == "synthetic":
        return "synthetic", None, "synthetic lengths (no trace)"
    if source in NAMED:
        file, cite = NAMED[source]
        return source, (workloads_dir() / file).resolve(), cite
    path = Path(source).expanduser()
    if not path.is_file():
        names = ", ".join([*NAMED, "synthetic"])
        raise ValueError(f"workload {source!r}: not one of {names} and no such file")
    known = {f: c for f, c in NAMED.values()}
    return path.stem, path.resolve(), known.get(path.name, f"user trace {path.name}")


def _azure_time(s: str) -> datetime:
    day, _, frac = s.strip().partition(".")
    return datetime.strptime(day, "%Y-%m-%d %H:%M:%S").replace(microsecond=int((frac + "000000")[:6]))


def read_azure(path: Path) -> Iterator[TraceRow]:
    with open(path, newline="") as f:
        first: datetime | None = None
        for r in csv.DictReader(f):
            t = _azure_time(r["TIMESTAMP"])
            first = first or t
            yield TraceRow((t - first).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]))


def read_mooncake(path: Path) -> Iterator[TraceRow]:
    with open(path) as f:
        first: float | None = None
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            first = d["timestamp"] if first is None else first
            yield TraceRow((d["timestamp"] - first) / 1000.0, int(d["input_length"]), int(d["output_length"]),
                           [int(h) for h in d.get("hash_ids") or []])


def read_trace(path: Path) -> tuple[str, Iterator[TraceRow]]:
    """('azure' | 'mooncake', rows) by the file's suffix."""
    if path.suffix == ".csv":
        return "azure", read_azure(path)
    if path.suffix in (".jsonl", ".json"):
        return "mooncake", read_mooncake(path)
    raise ValueError(f"{path}: unknown trace format (want .csv Azure or .jsonl Mooncake)")


SAMPLE_UNITS = ("rows", "conversations")


def select_rows(rows: Iterator[TraceRow], n: int, sample_seed: int | None,
                unit: str = "rows") -> list[TraceRow]:
    """The first n rows, or a seeded sample of n rows (or of whole conversations, cut at n rows) in
    trace order; offsets restart at the first one."""
    if unit not in SAMPLE_UNITS:
        raise ValueError(f"sample unit {unit!r}: want one of {', '.join(SAMPLE_UNITS)}")
    if unit == "conversations" and sample_seed is None:
        raise ValueError("sampling conversations needs a sample seed (--sample-seed)")
    picked = list(islice(rows, n)) if sample_seed is None else list(rows)
    if sample_seed is not None and n < len(picked):
        if unit == "rows":
            idx = sorted(random.Random(sample_seed).sample(range(len(picked)), n))
        else:
            convs = trace_conversations(picked)
            random.Random(sample_seed).shuffle(convs)
            idx = []
            for c in convs:
                if len(idx) >= n:
                    break
                idx += c[: n - len(idx)]  # only the last one drawn is cut, keeping its first turns
            idx.sort()
        picked = [picked[i] for i in idx]
    if len(picked) < n:
        raise ValueError(f"the trace has only {len(picked)} rows, {n} requested")
    t0 = picked[0].timestamp_s if picked else 0.0
    return [TraceRow(r.timestamp_s - t0, r.input_len, r.output_len, r.hash_ids) for r in picked]


def trace_conversations(rows: list[TraceRow], block: int = MOONCAKE_BLOCK) -> list[list[int]]:
    """Row indices of each conversation of a Mooncake trace, conversations in the order of their
    first row. A row continues an earlier one when its hash_ids start with the earlier row's full
    blocks (all its ids but the last, whose block is partial unless its input length is a multiple
    of the block) and those are at least two (the first block is a system prompt every request of
    the conversation trace shares). The longest such prefix wins, and of the rows holding it the
    latest. A row is continued once; a second continuation starts a conversation of its own."""
    owner: dict[tuple[int, ...], int] = {}  # full-block prefix of a row -> that row
    taken: set[int] = set()
    conv_of: list[int] = []
    convs: list[list[int]] = []
    for j, r in enumerate(rows):
        h = tuple(r.hash_ids or ())
        parent = next((owner[h[:k]] for k in range(len(h), 1, -1) if h[:k] in owner), None)
        if parent is not None and parent not in taken:
            taken.add(parent)
            conv_of.append(conv_of[parent])
            convs[conv_of[parent]].append(j)
        else:
            conv_of.append(len(convs))
            convs.append([j])
        full = len(h) if r.input_len % block == 0 else len(h) - 1
        if full >= 2:
            owner[h[:full]] = j
    return convs


def mooncake_segments(hash_ids: list[int], prompt_len: int, block: int) -> list[tuple[str, int]]:
    """Segments [(key, tokens)] of a prompt: full blocks for the leading ids, the rest from the last id."""
    if not hash_ids:
        return [("unhashed", prompt_len)]
    k = min(len(hash_ids), -(-prompt_len // block))
    last = (f"h{hash_ids[k - 1]}", prompt_len - (k - 1) * block)
    return [(f"h{h}", block) for h in hash_ids[:k - 1]] + [last]


def load_workload(cfg: WorkloadConfig, tokenizer: Any | None = None,
                  tokenizer_name: str | None = None) -> Workload:
    if cfg.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    name, path, citation = resolve_source(cfg.source)
    if path is None:
        rng = random.Random(f"{cfg.seed}:lengths")
        din, dout = LengthDist.parse(cfg.synthetic_input), LengthDist.parse(cfg.synthetic_output)
        rows = [TraceRow(0.0, din.sample(rng), dout.sample(rng)) for _ in range(cfg.num_requests)]
        kind, selection = "synthetic", f"prompt {din}, output {dout} (seed {cfg.seed})"
    else:
        kind, it = read_trace(path)
        if cfg.sample_unit == "conversations" and kind != "mooncake":
            raise ValueError("sampling conversations needs a Mooncake trace (hash_ids)")
        rows = select_rows(it, cfg.num_requests, cfg.sample_seed, cfg.sample_unit)
        selection = ("first rows" if cfg.sample_seed is None
                     else f"seeded sample of {cfg.sample_unit} in trace order (seed {cfg.sample_seed})")
    pairs = [(r.input_len, r.output_len) for r in rows]
    factor, rule = choose_factor(pairs, cfg.max_context, cfg.scale_lengths)
    prompts, outputs = scale_lengths(pairs, factor, cfg.max_output, cfg.max_context)
    block = block_tokens(factor, MOONCAKE_BLOCK) if kind == "mooncake" else None
    scaling = Scaling(factor, rule, cfg.max_context, cfg.max_output, block,
                      LengthStats.of([p for p, _ in pairs]), LengthStats.of(prompts),
                      LengthStats.of([o for _, o in pairs]), LengthStats.of(outputs))
    builder = PromptBuilder(cfg.seed, tokenizer)
    requests = []
    for i, (row, p, o) in enumerate(zip(rows, prompts, outputs)):
        segs = mooncake_segments(row.hash_ids or [], p, block) if block else [(f"r{i}", p)]
        if cfg.prompt_salt:
            segs = [(f"{cfg.prompt_salt}/{key}", n) for key, n in segs]
        prompt = builder.build(p, segs)
        requests.append(Request(i, prompt.text, p, o, row.timestamp_s if kind != "synthetic" else None,
                                prompt.tokens, row.hash_ids))
    return Workload(name, str(path) if path else None, citation, kind, selection, requests, scaling,
                    tokenizer_name)
