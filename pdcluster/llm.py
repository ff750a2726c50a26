"""Offline batch generation, disaggregated inside one process.

`LLM` runs a prefill engine and a decode engine that share the weights but own separate KV caches,
and hands every request's KV from one to the other through `kv_transfer` (the in-process
backend), exactly as the cluster does across workers: reserve on decode -> prefill pushes layers
-> commit with the first token -> decode loop.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
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
    ) -> None:
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
        prefill = Engine(cfg, "prefill", model_cfg, seed=seed)
        decode = Engine(cfg, "decode", model_cfg, model=prefill.runner.model, seed=seed)
        self.prefill = PrefillEngine(prefill, create_sender("inproc", prefill.runner.compat_hash,
                                                                compression=kv_compression))
        self.decode = DecodeEngine(decode, backend="inproc")
        self.model_config = model_cfg
        self.max_model_len = prefill.max_model_len
        self._ids = itertools.count()

    def __del__(self) -> None:
        decode = getattr(self, "decode", None)
        if decode is not None:
            decode.close()

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
            self.prefill.engine.validate(ids, p)  # every request is checked before any work starts
            out = RequestOutput(f"req-{next(self._ids)}", prompt if isinstance(prompt, str) else None, ids)
            out.logprobs = [] if p.logprobs is not None else None
            outputs.append(out)
            if p.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
            detoks.append(IncrementalDetokenizer(self.tokenizer, ids, p.stop) if self.tokenizer else None)
        by_id = {o.request_id: i for i, o in enumerate(outputs)}
        pending = deque(range(len(outputs)))
        bar = tqdm(total=len(outputs), desc="generate", disable=not use_tqdm)
        remaining = len(outputs)

        def emit(i: int, tokens: list[int], logprobs: list[TokenLogprobs], finish: str | None) -> None:
            nonlocal remaining
            out, detok = outputs[i], detoks[i]
            for t in tokens:
                out.token_ids.append(t)
                if detok is None:
                    continue
                out.text += detok.add(t)
                if detok.stopped:
                    finish = "stop"
                    self.decode.abort_request(out.request_id)
                    break
            if out.logprobs is not None:
                out.logprobs.extend(logprobs[: len(out.token_ids) - len(out.logprobs)])
            if finish is not None:
                out.text += detok.flush() if detok else ""
                out.finish_reason = finish
                remaining -= 1
                bar.update(1)

        while remaining:
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
                    out = outputs[by_id[r.request_id]]
                    out.num_cached_tokens = r.num_cached_tokens
                    emit(by_id[r.request_id], [r.first_token], [r.logprob] if r.logprob else [], r.finish_reason)
            if self.decode.has_work():
                for seq in self.decode.step():
                    progressed = True
                    i = by_id[seq.request_id]
                    if outputs[i].finish_reason is None:
                        emit(i, [seq.token_ids[-1]], seq.logprobs[-1:], seq.finish_reason)
            if not progressed and not self.prefill.has_work() and not self.decode.has_work() and remaining:
                raise RuntimeError("no progress possible: the decode KV cache cannot hold the next prompt")
        bar.close()
        return outputs
