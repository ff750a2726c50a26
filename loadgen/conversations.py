"""Multi-turn chat conversations: their turns (lengths, think times) from flags or from a Mooncake
trace, and the history that makes each turn's prompt.

A conversation is a list of turns. Turn 0's prompt is a first prompt of `first-prompt` tokens; turn
k's prompt is turn k-1's prompt, then turn k-1's answer, then a new message of `message` tokens.
Turn k is sent `think` seconds after turn k-1's answer ended, so a conversation is a closed loop;
conversations start open-loop at the arrival process's offsets (conversation_run.py runs them).

With a tokenizer prompts are token ids: the next prompt is the server's `prompt_token_ids` + the
answer's `token_ids` + the new message's ids, so the history is reused exactly (a byte-level BPE
tokenizer does not give back the same ids for the decoded text of arbitrary ids). Without one,
prompts are text: the prompt's text + the answer's text + the message's text (approximate lengths).

From a trace: its requests are grouped into conversations by hash_ids (workload.trace_conversations:
a request continues an earlier one whose full blocks its prompt starts with).
Turn k's message is input_k - (input_{k-1} + output_{k-1}) tokens (at least 1).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from loadgen.prompts import PromptBuilder
from loadgen.scaling import LengthStats, Scaling, choose_factor
from loadgen.workload import (
    LengthDist,
    Request,
    TraceRow,
    Workload,
    read_trace,
    resolve_source,
    spec_numbers,
    trace_conversations,
)

PREFIX = "multiturn"  # --workload multiturn (from flags) | multiturn:TRACE (a Mooncake trace's conversations)


@dataclass
class ConversationConfig:
    source: str  # "multiturn" or "multiturn:TRACE" (a named Mooncake workload or a .jsonl path)
    conversations: int = 10
    turns: str = "fixed:3"  # from flags only
    first_prompt: str = "fixed:256"
    message: str = "fixed:64"
    output: str = "fixed:64"
    think: str = "fixed:1"
    min_turns: int = 2  # from a trace only: conversations with fewer turns are skipped
    seed: int = 0
    scale_lengths: float | None = None
    max_context: int | None = None
    max_output: int | None = None
    prompt_salt: str = ""

    @property
    def trace(self) -> str | None:
        return self.source.partition(":")[2] or None


@dataclass
class ThinkTime:
    """Seconds between an answer and the next turn: fixed:S | uniform:LO:HI | exponential:MEAN |
    trace[:F] (the gap between the trace's timestamps of the two turns, times F; F defaults to 1)."""

    kind: str
    a: float = 0.0
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> ThinkTime:
        kind, parsed = spec_numbers(spec)
        nums = [-1.0] if parsed is None else parsed
        want = {"fixed": (1,), "uniform": (2,), "exponential": (1,), "trace": (0, 1)}.get(kind)
        if (want is None or len(nums) not in want or any(x < 0 or not math.isfinite(x) for x in nums)
                or (kind == "uniform" and nums[1] < nums[0])):
            raise ValueError(f"--think-time {spec!r}: want fixed:S, uniform:LO:HI, exponential:MEAN or "
                             "trace[:F] (seconds >= 0)")
        if kind == "trace" and not nums:
            nums = [1.0]
        return cls(kind, *nums)

    def sample(self, rng: random.Random, trace_gap_s: float | None = None) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "exponential":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        if trace_gap_s is None:
            raise ValueError("--think-time trace needs a trace workload (multiturn:mooncake-conv or a .jsonl)")
        return max(0.0, trace_gap_s) * self.a

    def __str__(self) -> str:
        nums = [self.a, self.b][:{"uniform": 2}.get(self.kind, 1)]
        return self.kind + "".join(f":{x:g}" for x in nums)


@dataclass
class Turn:
    conversation: int
    turn: int
    message_len: int  # turn 0: the first prompt's tokens; later: the new message's tokens
    output_len: int
    think_s: float  # wait after the previous answer (turn 0: 0)
    prompt_len: int = 0  # expected prompt tokens: the history with full-length answers, plus the message


@dataclass
class Conversation:
    index: int
    turns: list[Turn]
    arrival_s: float | None = None  # the trace's offset of the first turn; None: from flags


@dataclass
class ConversationWorkload(Workload):
    conversations: list[Conversation] = field(default_factory=list)
    think: str = ""
    token_ids: bool = False  # prompts as token ids (with a tokenizer) or text

    def describe(self) -> list[str]:
        turns = [len(c.turns) for c in self.conversations]
        lines = super().describe()[:2] + self.scaling.lines()
        lines.append(f"dialogue   {len(turns)} conversations, {sum(turns)} turns ({min(turns)}-{max(turns)} "
                     f"per conversation), think time {self.think}; each turn's prompt is the history "
                     "(previous prompt + answer) plus a new message")
        lines.append("prompts    token ids, history from the server's prompt_token_ids + token_ids "
                     f"(return_token_ids), messages tokenized with {self.tokenizer}" if self.token_ids else
                     "prompts    text (no --tokenizer): the history is the previous prompt's text + the answer's "
                     "text, lengths approximate")
        return lines + [f"note       {n}" for n in self.notes]


def trace_turns(rows: list[TraceRow], members: list[int], think: ThinkTime, rng: random.Random,
                index: int) -> Conversation:
    """One trace conversation's turns, unscaled."""
    turns = []
    for k, j in enumerate(members):
        r = rows[j]
        if k == 0:
            msg, gap = r.input_len, 0.0
        else:
            prev = rows[members[k - 1]]
            msg, gap = max(1, r.input_len - prev.input_len - prev.output_len), r.timestamp_s - prev.timestamp_s
        turns.append(Turn(index, k, msg, r.output_len, think.sample(rng, gap) if k else 0.0))
    return Conversation(index, turns, rows[members[0]].timestamp_s)


def synthetic_conversations(n: int, turns: LengthDist, first: LengthDist, message: LengthDist,
                            output: LengthDist, think: ThinkTime, seed: int) -> list[Conversation]:
    rng = random.Random(f"{seed}:conversations")
    out = []
    for i in range(n):
        k = turns.sample(rng)
        out.append(Conversation(i, [Turn(i, t, (first if t == 0 else message).sample(rng), output.sample(rng),
                                         think.sample(rng) if t else 0.0) for t in range(k)]))
    return out


def final_context(c: Conversation) -> int:
    return sum(t.message_len + t.output_len for t in c.turns)


def scale(convs: list[Conversation], factor: float, max_output: int | None,
          max_context: int | None) -> int:
    """Scale every length by `factor` (max(1, floor(.)); outputs capped by `max_output`), set each
    turn's expected prompt length, and end a conversation before the turn that would not fit in
    `max_context` (at least its first turn stays). Returns how many turns were dropped."""
    dropped = 0
    for c in convs:
        kept, context = [], 0
        for t in c.turns:
            t.message_len = max(1, math.floor(t.message_len * factor))
            t.output_len = max(1, math.floor(t.output_len * factor))
            if max_output is not None:
                t.output_len = min(max_output, t.output_len)
            t.prompt_len = context + t.message_len
            if kept and max_context is not None and t.prompt_len + t.output_len > max_context:
                break
            kept.append(t)
            context = t.prompt_len + t.output_len
        dropped += len(c.turns) - len(kept)
        c.turns = kept
    return dropped


class MessageMaker:
    """Text (and, with a tokenizer, exactly `n` token ids) of first prompts and new messages."""

    def __init__(self, seed: int, tokenizer: Any | None, salt: str = "") -> None:
        self.builder = PromptBuilder(seed, tokenizer)
        self.tokenizer, self.salt = tokenizer, salt
        self._specials = tokenizer.encode("") if tokenizer is not None else []

    def first(self, turn: Turn) -> tuple[str, list[int] | None]:
        key = f"{self.salt}c{turn.conversation}/t0"
        text = self.builder.build(turn.message_len, [(key, turn.message_len)]).text
        return text, (self.tokenizer.encode(text) if self.tokenizer is not None else None)

    def message(self, turn: Turn) -> tuple[str, list[int] | None]:
        """A new message: text starting with a space; ids without the tokenizer's special tokens."""
        key, n = f"{self.salt}c{turn.conversation}/t{turn.turn}", turn.message_len
        text = " " + " ".join(self.builder.words(key, n))
        if self.tokenizer is None:
            return text, None
        ids: list[int] = []
        for want in (n, 2 * n, 4 * n):  # a word is at least one token: the first pass nearly always does
            ids = self._strip(self.tokenizer.encode(" ".join(self.builder.words(key, want))))
            if len(ids) >= n:
                break
        return text, ids[:n]

    def _strip(self, ids: list[int]) -> list[int]:
        k = len(self._specials)
        return ids[k:] if k and ids[:k] == self._specials else ids


@dataclass
class History:
    """One conversation's prompt so far: token ids (with a tokenizer) or text."""

    maker: MessageMaker
    ids: list[int] | None = None
    text: str = ""

    def prompt(self, turn: Turn) -> str | list[int]:
        """The prompt of `turn`: the first prompt, or the history plus a new message."""
        text, ids = self.maker.first(turn) if turn.turn == 0 else self.maker.message(turn)
        if ids is not None:
            self.ids = ids if turn.turn == 0 else [*(self.ids or []), *ids]
            return list(self.ids)
        self.text = text if turn.turn == 0 else self.text + text
        return self.text

    def answered(self, prompt_ids: list[int] | None, answer_ids: list[int] | None, answer_text: str) -> str:
        """Take the answer into the history; returns where its ids came from ("token_ids", or "text"
        when the server sent none and the text was encoded, or "" without a tokenizer)."""
        if self.ids is None:
            self.text += answer_text
            return ""
        if prompt_ids is not None:
            self.ids = list(prompt_ids)
        if answer_ids is not None:
            self.ids += answer_ids
            return "token_ids"
        self.ids += self.maker._strip(self.maker.tokenizer.encode(answer_text))
        return "text"


def _dist(flag: str, spec: str) -> LengthDist:
    try:
        return LengthDist.parse(spec)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _from_trace(cfg: ConversationConfig, think: ThinkTime,
                rng: random.Random) -> tuple[list[Conversation], str, str, str, str]:
    """(conversations, name, selection, path, citation) of a Mooncake trace."""
    name, path, citation = resolve_source(cfg.trace or "")
    kind, it = read_trace(path) if path is not None else ("synthetic", iter(()))
    if kind != "mooncake":
        raise ValueError(f"--workload {cfg.source}: conversations come from a Mooncake .jsonl trace (its hash_ids "
                         f"link the turns); {cfg.trace!r} is not one")
    rows = list(it)
    groups = [g for g in trace_conversations(rows) if len(g) >= cfg.min_turns]
    if len(groups) < cfg.conversations:
        raise ValueError(f"the trace has only {len(groups)} conversations of at least --min-turns "
                         f"{cfg.min_turns} turns, {cfg.conversations} requested")
    picked = groups[:cfg.conversations]
    t0 = rows[picked[0][0]].timestamp_s
    convs = [trace_turns(rows, g, think, rng, i) for i, g in enumerate(picked)]
    for c in convs:
        c.arrival_s = (c.arrival_s or 0.0) - t0
    selection = f"the first {len(picked)} conversations of at least {cfg.min_turns} turns, grouped by hash_ids"
    return convs, f"{name} conversations", selection, str(path), citation


def load_conversations(cfg: ConversationConfig, tokenizer: Any | None = None,
                       tokenizer_name: str | None = None) -> ConversationWorkload:
    """The conversations of `cfg`, scaled, with one placeholder Request per turn (prompts are built
    while the run goes, from the answers)."""
    if cfg.conversations < 1:
        raise ValueError(f"--conversations must be at least 1, got {cfg.conversations}")
    if cfg.min_turns < 1:
        raise ValueError(f"--min-turns must be at least 1, got {cfg.min_turns}")
    think = ThinkTime.parse(cfg.think)
    rng = random.Random(f"{cfg.seed}:think")
    if cfg.trace is None:
        if think.kind == "trace":
            raise ValueError("--think-time trace needs a trace: --workload multiturn:mooncake-conv (or a .jsonl)")
        dists = [_dist(f, s) for f, s in (("--turns", cfg.turns), ("--first-prompt-len", cfg.first_prompt),
                                          ("--message-len", cfg.message), ("--output-len", cfg.output))]
        convs = synthetic_conversations(cfg.conversations, *dists, think, cfg.seed)
        name, path, citation = PREFIX, None, "synthetic conversations (no trace)"
        selection = (f"turns {dists[0]}, first prompt {dists[1]}, messages {dists[2]}, outputs {dists[3]} "
                     f"(seed {cfg.seed})")
    else:
        convs, name, selection, path, citation = _from_trace(cfg, think, rng)
    messages = [t.message_len for c in convs for t in c.turns]
    outputs = [t.output_len for c in convs for t in c.turns]
    pairs = [(final_context(c) - c.turns[-1].output_len, c.turns[-1].output_len) for c in convs]
    factor, rule = choose_factor(pairs, cfg.max_context, cfg.scale_lengths)
    dropped = scale(convs, factor, cfg.max_output, cfg.max_context)
    scaling = Scaling(factor, rule.replace("prompt+output", "conversation"), cfg.max_context, cfg.max_output,
                      None, LengthStats.of(messages), LengthStats.of([t.message_len for c in convs for t in c.turns]),
                      LengthStats.of(outputs), LengthStats.of([t.output_len for c in convs for t in c.turns]))
    notes = ["scaling applies to each turn's new message (turn 0: the first prompt) and output"]
    if dropped:
        notes.append(f"{dropped} turn(s) dropped: past --max-context {cfg.max_context} with the history")
    if tokenizer is None:
        notes.append("no --tokenizer: prompts are text, so the history is not reused token for token")
    turns = [t for c in convs for t in c.turns]
    requests = [Request(i, "", t.prompt_len, t.output_len, None) for i, t in enumerate(turns)]
    return ConversationWorkload(name, path, citation, PREFIX, selection, requests, scaling, tokenizer_name, notes,
                                convs, str(think), tokenizer is not None)
