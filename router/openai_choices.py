"""The choices of one OpenAI request: each prompt (a completion may send a list of them) becomes one
router request carrying `n` and `best_of`, which the router runs as that many choices
(router/choices.py: choice k samples with seed + k, the first one leads so the others find its
prompt's KV in the prefix caches, best_of keeps the n of highest cumulative logprob); the answer's
choices are put back together from their messages.

Choice k of prompt i is answer index i * n + k (vLLM's numbering). Prompt i's router request has
the request id `<id>-<i>` (the id itself when there is only one prompt). Pure functions;
router/http_choices.py runs the calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import generate_pb2 as gen
from router.openai_protocol import OpenAIRequest
from router.openai_responses import Output


@dataclass(frozen=True)
class PromptCall:
    prompt: int  # which of the request's prompts
    grpc: gen.GenerateRequest


def prompt_calls(req: OpenAIRequest) -> list[PromptCall]:
    """The router requests `req` becomes, one per prompt (the template carries the first prompt)."""
    calls = []
    for i, prompt in enumerate(req.prompts):
        g = gen.GenerateRequest()
        g.CopyFrom(req.grpc)
        if i:
            prompt.set_on(g)
        if len(req.prompts) > 1:
            g.request_id = f"{req.id}-{i}"
        if req.n > 1:
            g.sampling.n = req.n
        if req.best_of > req.n:
            g.sampling.best_of = req.best_of
        calls.append(PromptCall(i, g))
    return calls


def slot(req: OpenAIRequest, prompt: int, msg: gen.GenerateResponse) -> int:
    """The answer index of a message of prompt `prompt`'s router request."""
    return prompt * req.n + msg.index


def usage(req: OpenAIRequest, outs: list[Output]) -> dict[str, int]:
    """Prompt tokens once per prompt, completion tokens of every choice generated (best_of's too:
    they were computed; the router counts them in its last message's total)."""
    groups = [outs[i * req.n:(i + 1) * req.n] for i in range(len(outs) // req.n)]
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(max(sum(o.completion_tokens for o in g), max(o.total_completion_tokens for o in g))
                     for g in groups)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
