"""The offline benchmarks' workload: rows of an Azure LLM inference trace, their lengths scaled by
loadgen's rule (loadgen/scaling.py) to fit a context, and random prompt token ids."""

from __future__ import annotations

from pathlib import Path

import torch

from loadgen.scaling import choose_factor
from loadgen.scaling import scale_lengths as scaled
from loadgen.workload import NAMED, read_azure, workloads_dir

DEFAULT_TRACE = workloads_dir() / NAMED["azure-conv"][0]  # the shipped trace (loadgen/traces), or $PDCLUSTER_WORKLOADS


def load_trace(path: Path, num_requests: int, seed: int | None) -> list[tuple[int, int]]:
    """(ContextTokens, GeneratedTokens) of the first `num_requests` rows, or a seeded sample in trace order."""
    rows = [(r.input_len, r.output_len) for r in read_azure(path)]
    if num_requests > len(rows):
        raise SystemExit(f"--num-requests {num_requests} exceeds the {len(rows)} rows of {path}")
    if seed is None:
        return rows[:num_requests]
    g = torch.Generator().manual_seed(seed)
    picked = sorted(torch.randperm(len(rows), generator=g)[:num_requests].tolist())
    return [rows[i] for i in picked]


def scale_lengths(rows: list[tuple[int, int]], max_context: int, max_output: int) -> tuple[float, list[int], list[int]]:
    """(factor, prompt lengths, output lengths): every request with its output fits in `max_context`,
    outputs capped at `max_output` after scaling; exits when the context is too small for the floors."""
    factor, _ = choose_factor(rows, max_context)
    try:
        prompts, outputs = scaled(rows, factor, max_output, max_context)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return factor, prompts, outputs


def make_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """Random token ids in [3, vocab), one prompt per length, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
