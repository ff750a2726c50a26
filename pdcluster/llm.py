"""Offline batch generation in one process, colocated or disaggregated.

`mode="colocated"` (the default) runs one engine: every step batches the generating sequences'
next tokens with prompt chunks (the mixed steps of `engine.scheduler`), as vLLM's offline `LLM`
does. `mode="disaggregated"` runs a prefill engine and a decode engine that share the weights but
own separate KV caches, and hands every request's KV from one to the other through `kv_transfer`
(the in-process backend), exactly as the cluster does across workers: reserve on decode ->
prefill pushes layers -> commit with the first token -> decode loop. Both give the same tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable
from typing import Sequence as Seq

from tqdm.auto import tqdm

from decode_worker import DecodeEngine
from engine.builtin_model import resolve_model_path
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine import Engine
from engine.kv_tier import new_tier_path
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from engine.tokenizer import load_tokenizer
from engine.tp_ranks import threads_per_rank
from kv_transfer import create_sender
from prefill_worker import PrefillEngine

Prompt = str | list[int]
MODES = ("colocated", "disaggregated")


@dataclass
class CompletionOutput:
    """One choice of a request (SamplingParams.n / best_of)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs or best_of)


@dataclass
class RequestOutput:
    """A prompt's answer: `outputs` holds its n choices (vLLM's shape); `token_ids`, `text`,
    `finish_reason` and `logprobs` are the first choice's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput(0)])
    num_cached_tokens: int = 0  # prompt tokens served from the prefill worker's prefix cache
    # with SamplingParams.prompt_logprobs: prompt tokens 1.. (the first has none), as vLLM's after its None
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


class LLM:
    """`LLM(model).generate(prompts, SamplingParams(...))` -> one `RequestOutput` per prompt.

    With `SamplingParams.n` / `best_of`, a prompt is prefilled once and its choices fork from it in
    the engine (the prompt's KV blocks shared, the last one copied: engine/scheduler.py `_fork`)."""

    def __init__(
        self,
        model: str = "builtin:stdlib-4m",
        *,
        dtype: str = "auto",
        device: str | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        kv_compression: str = "none",
        kv_cache_dtype: str = "auto",
        kv_sink_tokens: int = 0,
        kv_recent_tokens: int | None = None,
        kv_offload_bytes: int = 0,
        enforce_eager: bool = False,
        mode: str = "colocated",
        tensor_parallel_size: int = 1,
        decode_tensor_parallel_size: int | None = None,
        num_threads: int | None = None,
        expert_parallel: bool = False,
    ) -> None:
        """`tensor_parallel_size` N > 1: each engine's model is split over N processes (its own and
        N - 1 children, gloo between them; engine/tp_layout.py says how); `expert_parallel`: a
        mixture-of-experts model's routed experts placed whole, E/N per rank. Disaggregated:
        `decode_tensor_parallel_size` is the decode engine's (default: the same). `num_threads`:
        CPU threads of each process (default: the cores shared by the largest group's ranks).
        `kv_cache_dtype`: "auto" or quantized KV pages ("int8", "fp8_e4m3", "fp8_e5m2");
        `kv_recent_tokens` (with `kv_sink_tokens`): an approximate bound on each sequence's KV
        (docs/kv_cache.md); `kv_offload_bytes` > 0: blocks evicted from the prefix cache go to an
        offload tier of that size in /dev/shm (both engines' when disaggregated) and come back on a
        prefix hit."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        decode_tp = tensor_parallel_size if decode_tensor_parallel_size is None else decode_tensor_parallel_size
        if decode_tp != tensor_parallel_size and mode != "disaggregated":
            raise ValueError("decode_tensor_parallel_size applies to mode='disaggregated'")
        if kv_compression != "none" and kv_cache_dtype != "auto":
            raise ValueError(f"kv_compression {kv_compression!r} compresses KV of the model's dtype; kv_cache_dtype "
                             f"{kv_cache_dtype!r} pages are already quantized and travel as they are stored")
        if kv_compression != "none" and mode != "disaggregated":
            raise ValueError("kv_compression applies to KV moved between engines: it needs mode='disaggregated'")
        path = resolve_model_path(model)
        model_cfg = ModelConfig.from_pretrained(path)
        cfg = EngineConfig(
            model=str(path),
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            kv_cache_dtype=kv_cache_dtype,
            kv_sink_tokens=kv_sink_tokens,
            kv_recent_tokens=kv_recent_tokens,
            kv_offload_bytes=kv_offload_bytes,
            kv_offload_path=new_tier_path() if kv_offload_bytes else None,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            num_threads=(threads_per_rank(max(tensor_parallel_size, decode_tp), num_threads)
                         if max(tensor_parallel_size, decode_tp) > 1 else num_threads),
            tensor_parallel_size=tensor_parallel_size,
            expert_parallel=expert_parallel,
        )
        self.tokenizer = load_tokenizer(path)
        self.mode = mode
        self.model_config = model_cfg
        # colocated: `engine`; disaggregated: `prefill` and `decode` (the other attributes are None)
        self.engine: Engine | None = None
        self.prefill: PrefillEngine | None = None
        self.decode: DecodeEngine | None = None
        if mode == "colocated":
            self.engine = Engine(cfg, "colocated", model_cfg, seed=seed)
            self.max_model_len = self.engine.max_model_len
        else:
            prefill = Engine(cfg, "prefill", model_cfg, seed=seed)
            shared = prefill.model if tensor_parallel_size == decode_tp == 1 else None  # a rank loads its own shard
            try:
                decode = Engine(dataclasses.replace(cfg, tensor_parallel_size=decode_tp), "decode", model_cfg,
                                model=shared, seed=seed)
            except BaseException:
                prefill.close()
                raise
            self.prefill = PrefillEngine(prefill, create_sender("inproc", prefill.compat_hash,
                                                                    compression=kv_compression))
            self.decode = DecodeEngine(decode, backend="inproc")
            self.max_model_len = prefill.max_model_len
        self._ids = itertools.count()

    def close(self) -> None:
        """Release what this LLM holds beyond memory: the KV receiver, the other tensor-parallel ranks."""
        for part in (getattr(self, "decode", None), getattr(self, "prefill", None), getattr(self, "engine", None)):
            if part is not None:
                part.close()  # (a PrefillEngine or DecodeEngine closes its engine)

    def __del__(self) -> None:
        self.close()

    @property
    def engines(self) -> list[Engine]:
        """The engines this LLM steps (one colocated, or prefill and decode)."""
        if self.engine is not None:
            return [self.engine]
        return [self.prefill.engine, self.decode.engine]

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        outputs = []
        for prompt, p in zip(prompts, params):
            ids = self.encode(prompt)
            self.engines[0].validate(ids, p)  # every request is checked before any work starts
            if p.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
            want_logprobs = p.logprobs is not None
            out = RequestOutput(f"req-{next(self._ids)}", prompt if isinstance(prompt, str) else None, ids,
                                [CompletionOutput(k, logprobs=[] if want_logprobs else None)
                                 for k in range(p.num_choices)])
            outputs.append(out)
        shown = [p.logprobs is not None for p in params]  # else computed only to rank best_of's choices
        # best_of ranks the choices by the sampled tokens' logprobs: the engine computes those
        params = [dataclasses.replace(p, logprobs=0) if p.num_choices > p.n and p.logprobs is None else p
                  for p in params]
        bar = tqdm(total=sum(len(o.outputs) for o in outputs), desc="generate", disable=not use_tqdm)
        run = GenerateRun(outputs, params, shown, self.tokenizer, bar, self._abort)
        try:
            if self.engine is not None:
                self._generate_colocated(run, params)
            else:
                self._generate_disaggregated(run, params)
        finally:  # free what unfinished requests hold (an error, a choice's stop string); the LLM stays usable
            for out in outputs:
                self._abort(out.request_id)
            bar.close()
        for out, p in zip(outputs, params):
            out.outputs = best_choices(out.outputs, p.n)
        return outputs

    def _abort(self, request_id: str, index: int | None = None) -> None:
        """Drop the request (or its choice `index`) wherever it is."""
        if self.engine is not None:
            self.engine.abort(request_id, index)
        else:
            if index is None:
                self.prefill.abort(request_id)
            self.decode.abort_request(request_id, index)

    def _generate_colocated(self, run: GenerateRun, params: list[SamplingParams]) -> None:
        engine = self.engine
        for out, p in zip(run.outputs, params):
            engine.add_request(out.request_id, out.prompt_token_ids, p)
        while run.remaining:
            if not engine.has_work():
                raise RuntimeError("no progress possible: the engine has no work but requests are unfinished")
            for seq in engine.step():
                i = run.by_id[seq.request_id]
                out = run.outputs[i]
                if seq.index == 0 and seq.num_output_tokens == 1:
                    out.num_cached_tokens = seq.num_cached_tokens
                    if seq.params.prompt_logprobs is not None:
                        out.prompt_logprobs = list(seq.prompt_logprobs)
                run.emit(i, seq.index, [seq.token_ids[-1]], seq.logprobs[-1:], seq.finish_reason)

    def _generate_disaggregated(self, run: GenerateRun, params: list[SamplingParams]) -> None:
        outputs = run.outputs
        pending = deque(range(len(outputs)))
        while run.remaining:
            while pending:  # hand out as many prompts as the decode cache can take
                i = pending[0]
                out = outputs[i]
                ticket = self.decode.reserve(out.request_id, out.prompt_token_ids, params[i])
                if ticket is None:
                    break
                pending.popleft()
                self.prefill.add(out.request_id, out.prompt_token_ids, params[i], ticket)
            progressed = False
            if self.prefill.has_work():
                for r in self.prefill.step():
                    progressed = True
                    if r.error is not None:
                        raise RuntimeError(f"request {r.request_id}: {r.error}")
                    i = run.by_id[r.request_id]
                    outputs[i].num_cached_tokens = r.num_cached_tokens
                    if params[i].prompt_logprobs is not None:
                        outputs[i].prompt_logprobs = list(r.prompt_logprobs)
                    run.emit(i, 0, [r.first_token], [r.logprob] if r.logprob else [], r.finish_reason)
            if self.decode.has_work():
                for seq in self.decode.step():
                    progressed = True
                    run.emit(run.by_id[seq.request_id], seq.index, [seq.token_ids[-1]], seq.logprobs[-1:],
                             seq.finish_reason)
            if not progressed and not self.prefill.has_work() and not self.decode.has_work() and run.remaining:
                raise RuntimeError("no progress possible: the decode KV cache cannot hold the next prompt")


def best_choices(choices: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The n choices to return: all (n of n), or the n of highest cumulative logprob of best_of,
    in that order (ties: the lower index first), renumbered 0.. ."""
    if len(choices) == n:
        return choices
    best = sorted(choices, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[:n]
    return [dataclasses.replace(c, index=j) for j, c in enumerate(best)]


class GenerateRun:
    """One `generate` call's outputs as tokens arrive: each choice's text, stop strings, logprobs,
    the progress bar (one step per choice)."""

    def __init__(self, outputs: list[RequestOutput], params: list[SamplingParams], shown: list[bool],
                 tokenizer: object, bar: tqdm, abort: Callable[[str, int], None]) -> None:
        self.outputs = outputs
        self.detoks = [[IncrementalDetokenizer(tokenizer, o.prompt_token_ids, p.stop, p.min_tokens)
                        if tokenizer else None for _ in o.outputs] for o, p in zip(outputs, params)]
        self.shown = shown  # per request: logprobs asked for (else computed only to rank best_of's choices)
        self.bar = bar
        self.abort = abort
        self.by_id = {o.request_id: i for i, o in enumerate(outputs)}
        self.remaining = sum(len(o.outputs) for o in outputs)

    def emit(self, i: int, index: int, tokens: list[int], logprobs: list[TokenLogprobs], finish: str | None) -> None:
        out, detok = self.outputs[i].outputs[index], self.detoks[i][index]
        if out.finish_reason is not None:  # a stop string ended it; the engine's sequence runs on
            return
        for t in tokens:
            out.token_ids.append(t)
            if detok is None:
                continue
            out.text += detok.add(t)
            if detok.stopped:
                finish = "stop"
                self.abort(self.outputs[i].request_id, index)
                break
        if logprobs and out.logprobs is None and not self.shown[i]:
            out.logprobs = []
        if out.logprobs is not None:
            out.logprobs.extend(logprobs[: len(out.token_ids) - len(out.logprobs)])
        if finish is not None:
            out.text += detok.flush() if detok else ""
            out.finish_reason = finish
            if out.logprobs is not None:
                out.cumulative_logprob = sum(lp.logprob for lp in out.logprobs)
                if not self.shown[i]:
                    out.logprobs = None
            self.remaining -= 1
            self.bar.update(1)
