"""A stand-in for vLLM's offline API (LLM, SamplingParams, inputs.TokensPrompt), for the tests of
scripts/bench_vs_vllm.py where vLLM is not installed. It serves with pdcluster's own engine, so its
greedy tokens are the real ones; only the name is borrowed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    outputs: list[_Completion]


class LLM:
    def __init__(self, model: str, dtype: str = "auto", max_model_len: int | None = None, **_: object) -> None:
        import pdcluster

        self._llm = pdcluster.LLM(model, dtype=dtype, max_model_len=max_model_len, enforce_eager=True)

    def generate(self, prompts, params, use_tqdm: bool = True) -> list[_Output]:
        import pdcluster

        ours = [pdcluster.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, ignore_eos=p.ignore_eos)
                for p in params]
        outs = self._llm.generate([p["prompt_token_ids"] for p in prompts], ours)
        return [_Output([_Completion(o.token_ids)]) for o in outs]
