"""Offline batch generation in one process, colocated or disaggregated.

`mode="colocated"` (the default) runs one engine: every step batches the generating sequences'
next tokens with prompt chunks (the mixed steps of `engine.scheduler`), as vLLM's offline `LLM`
does. `mode="disaggregated"` runs a prefill engine and a decode engine that share the weights but
own separate KV caches, and hands every request's KV from one to the other through `kv_transfer`
(the in-process backend), exactly as the cluster does across workers: reserve on decode ->
prefill pushes layers -> commit with the first token -> decode loop. Both give the same tokens.
"""

from __future__ import annotations

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
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from engine.tokenizer import load_tokenizer
from kv_transfer import create_sender
from prefill_worker import PrefillEngine

Prompt = str | list[int]
MODES = ("colocated", "disaggregated")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefill worker's prefix cache
    # with SamplingParams.prompt_logprobs: prompt tokens 1.. (the first has none), as vLLM's after its None
    prompt_logprobs: list[TokenLogprobs] | None = None


class LLM:
    """`LLM(model).generate(prompts, SamplingParams(...))` -> one `RequestOutput` per prompt."""

    def __init__(
        self,
        model: str = "builtin:tiny-llama",
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
        enforce_eager: bool = False,
        mode: str = "colocated",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
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
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
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
            decode = Engine(cfg, "decode", model_cfg, model=prefill.model, seed=seed)
            self.prefill = PrefillEngine(prefill, create_sender("inproc", prefill.compat_hash,
                                                                    compression=kv_compression))
            self.decode = DecodeEngine(decode, backend="inproc")
            self.max_model_len = prefill.max_model_len
        self._ids = itertools.count()

    def __del__(self) -> None:
        decode = getattr(self, "decode", None)
        if decode is not None:
            decode.close()

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
        outputs, detoks = [], []
        for prompt, p in zip(prompts, params):
            ids = self.encode(prompt)
            self.engines[0].validate(ids, p)  # every request is checked before any work starts
            out = RequestOutput(f"req-{next(self._ids)}", prompt if isinstance(prompt, str) else None, ids)
            out.logprobs = [] if p.logprobs is not None else None
            outputs.append(out)
            if p.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
            detoks.append(IncrementalDetokenizer(self.tokenizer, ids, p.stop, p.min_tokens) if self.tokenizer else None)
        bar = tqdm(total=len(outputs), desc="generate", disable=not use_tqdm)
        run = GenerateRun(outputs, detoks, bar, self._abort)
        try:
            if self.engine is not None:
                self._generate_colocated(run, params)
            else:
                self._generate_disaggregated(run, params)
        except BaseException:  # free what the unfinished requests hold; the LLM stays usable
            for out in outputs:
                if out.finish_reason is None:
                    self._abort(out.request_id)
            raise
        finally:
            bar.close()
        return outputs

    def _abort(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.abort(request_id)
        else:
            self.prefill.abort(request_id)
            self.decode.abort_request(request_id)

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
                if out.finish_reason is None:
                    if not out.token_ids:
                        out.num_cached_tokens = seq.num_cached_tokens
                        if seq.params.prompt_logprobs is not None:
                            out.prompt_logprobs = list(seq.prompt_logprobs)
                    run.emit(i, [seq.token_ids[-1]], seq.logprobs[-1:], seq.finish_reason)

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
                    run.emit(i, [r.first_token], [r.logprob] if r.logprob else [], r.finish_reason)
            if self.decode.has_work():
                for seq in self.decode.step():
                    progressed = True
                    i = run.by_id[seq.request_id]
                    if outputs[i].finish_reason is None:
                        run.emit(i, [seq.token_ids[-1]], seq.logprobs[-1:], seq.finish_reason)
            if not progressed and not self.prefill.has_work() and not self.decode.has_work() and run.remaining:
                raise RuntimeError("no progress possible: the decode KV cache cannot hold the next prompt")


class GenerateRun:
    """One `generate` call's outputs as tokens arrive: text, stop strings, logprobs, the progress bar."""

    def __init__(self, outputs: list[RequestOutput], detoks: list[IncrementalDetokenizer | None], bar: tqdm,
                 abort: Callable[[str], None]) -> None:
        self.outputs = outputs
        self.detoks = detoks
        self.bar = bar
        self.abort = abort
        self.by_id = {o.request_id: i for i, o in enumerate(outputs)}
        self.remaining = len(outputs)

    def emit(self, i: int, tokens: list[int], logprobs: list[TokenLogprobs], finish: str | None) -> None:
        out, detok = self.outputs[i], self.detoks[i]
        for t in tokens:
            out.token_ids.append(t)
            if detok is None:
                continue
            out.text += detok.add(t)
            if detok.stopped:
                finish = "stop"
                self.abort(out.request_id)
                break
        if out.logprobs is not None:
            out.logprobs.extend(logprobs[: len(out.token_ids) - len(out.logprobs)])
        if finish is not None:
            out.text += detok.flush() if detok else ""
            out.finish_reason = finish
            self.remaining -= 1
            self.bar.update(1)
