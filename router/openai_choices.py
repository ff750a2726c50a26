"""The choices of one OpenAI request: each prompt (a completion may send a list of them) times
`best_of` (at least `n`) becomes its own router request, and the answer's choices are put back
together from them.

Choice k of prompt i is answer index i * n + k (vLLM's numbering). Its router request is the
template's with that prompt, the request id `<id>-<i>-<k>` (the id itself when there is only one)
and, with a seed, seed + k, so choice 0 samples as a request with n = 1 would. The first choice of
each prompt leads: the others start once it has its first token, so its prompt's KV is in the
prefix caches by then (the prefill worker's, and its decode worker's, which shares those blocks
with the later choices instead of receiving them again; the router sends them to the decode worker
that holds the longest prefix). Only the prompt's last, partial block is computed again per choice.

best_of > n: the n of highest cumulative logprob (the sum of the model's logprobs of the tokens
sampled) are returned, in that order. Pure functions; router/http_choices.py runs the calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import generate_pb2 as gen
from router.openai_protocol import OpenAIRequest
from router.openai_responses import Output


@dataclass(frozen=True)
class ChoiceCall:
    slot: int  # position among the calls: prompt * best_of + k
    prompt: int  # which of the request's prompts
    grpc: gen.GenerateRequest
    leader: bool  # the first call of its prompt (the others wait for its first token)


def choice_calls(req: OpenAIRequest) -> list[ChoiceCall]:
    """The router requests `req` becomes, in slot order (the template carries the first prompt)."""
    single = len(req.prompts) == 1 and req.best_of == 1
    calls = []
    for i, prompt in enumerate(req.prompts):
        for k in range(req.best_of):
            g = gen.GenerateRequest()
            g.CopyFrom(req.grpc)
            if i:
                prompt.set_on(g)
            if not single:
                g.request_id = f"{req.id}-{i}-{k}"
                if g.sampling.HasField("seed"):
                    g.sampling.seed = (g.sampling.seed + k) % 2**64
            if req.best_of > req.n and not g.sampling.HasField("logprobs"):
                g.sampling.logprobs = 0  # the sampled tokens' logprobs rank the choices
            calls.append(ChoiceCall(i * req.best_of + k, i, g, leader=k == 0))
    return calls


def cumulative_logprob(out: Output) -> float:
    return sum(lp.logprob for lp in out.logprobs)


def answer_choices(req: OpenAIRequest, outs: list[Output]) -> list[tuple[int, Output]]:
    """The answer's choices (index, output) from every call's output (in slot order): all of
    them, or per prompt the n best of best_of."""
    if req.best_of == req.n:
        return list(enumerate(outs))
    chosen = []
    for i in range(len(outs) // req.best_of):
        group = outs[i * req.best_of:(i + 1) * req.best_of]
        best = sorted(range(len(group)), key=lambda k: (-cumulative_logprob(group[k]), k))[:req.n]
        chosen += [(i * req.n + j, group[k]) for j, k in enumerate(best)]
    return chosen


def usage(req: OpenAIRequest, outs: list[Output]) -> dict[str, int]:
    """Prompt tokens once per prompt, completion tokens of every choice generated (best_of's too:
    they were computed)."""
    prompt = sum(outs[i * req.best_of].prompt_tokens for i in range(len(outs) // req.best_of))
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
