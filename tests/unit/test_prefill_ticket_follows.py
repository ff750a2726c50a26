"""A prefill whose ticket follows (prefill_worker/prefill_engine.py `add(ticket=None)` + `attach`):
the same tokens as with the ticket given up front whenever the ticket comes (before the prompt,
before its step, after its prefill finished, with some of the prompt already cached on the decode
side), a ticket that does not fit the prompt is refused, and an abort frees everything. The offline
LLM's own prefill and decode engines, in-process KV transfer; no network."""

from __future__ import annotations

import pytest
import torch

from pdcluster import LLM, SamplingParams
from tests.checkpoints import VOCAB

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def llm(checkpoint):
    llm = LLM(str(checkpoint("llama-gqa")), num_blocks=64, max_model_len=256, mode="disaggregated")
    yield llm
    llm.close()


def _prompt(n: int, seed: int = 5) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(llm, rid: str, first: int) -> list[int]:
    """The request's tokens: the first token from the prefill, the rest from the decode engine."""
    tokens = [first]
    while llm.decode.has_work():
        for seq in llm.decode.step():
            if seq.request_id == rid:
                tokens.append(seq.token_ids[-1])
    return tokens


def _run(llm, prompt: list[int], when: str, rid: str) -> list[int]:
    """Prefill `prompt` with its ticket attached `when`: early (before the prompt is added), queued
    (added, not stepped yet) or held (after its prefill finished); then decode it."""
    p = llm.prefill
    ticket = llm.decode.reserve(rid, prompt, GREEDY)
    if when == "early":
        assert p.attach(rid, ticket) is None
    p.add(rid, prompt, GREEDY, None)
    if when == "queued":
        assert p.attach(rid, ticket) is None
    results = p.step()
    if when == "held":
        assert results == [] and rid in p._held
        results = [p.attach(rid, ticket)]
    (r,) = results
    assert r.error is None and r.request_id == rid
    return _decode(llm, rid, r.first_token)


def test_the_same_tokens_whenever_the_ticket_comes(llm):
    prompt = _prompt(37)
    out = llm.generate([prompt], GREEDY)[0].token_ids  # the ticket given up front
    for i, when in enumerate(("early", "queued", "held")):
        assert _run(llm, prompt, when, f"r{i}") == out, when
    assert not llm.decode.has_work()
    assert not (llm.prefill._held or llm.prefill._lens or llm.prefill._early or llm.prefill._tickets)


def test_held_layers_send_only_the_blocks_the_decode_side_lacks(llm):
    """The decode worker holds the prompt's first two blocks (an earlier turn): its ticket names
    the blocks after them, and the held K/V of every block is cut to those."""
    prompt = _prompt(50, seed=9)
    out = llm.generate([prompt], GREEDY)[0].token_ids  # leaves the prompt in both prefix caches
    ticket = llm.decode.reserve("again", prompt, GREEDY)
    assert ticket.cached_tokens > 0
    llm.prefill.add("again", prompt, GREEDY, None)
    assert llm.prefill.step() == []
    r = llm.prefill.attach("again", ticket)
    assert r.error is None and _decode(llm, "again", r.first_token) == out


def test_a_ticket_that_does_not_fit_the_prompt_is_refused_and_an_abort_frees_all(llm):
    prompt = _prompt(20)
    used = llm.prefill.engine.block_manager.num_used_blocks
    other = llm.decode.reserve("other", _prompt(40), GREEDY)
    llm.prefill.add("r", prompt, GREEDY, None)
    with pytest.raises(ValueError, match="ticket covers 40 tokens, prompt has 20"):
        llm.prefill.attach("r", other)
    assert llm.prefill.step() == []  # prefilled, held for a ticket that fits
    with pytest.raises(ValueError, match="ticket covers 40 tokens"):
        llm.prefill.attach("r", other)
    assert llm.prefill.abort("r")  # what the worker does with a refused ticket
    llm.prefill.add("s", prompt, GREEDY, None)
    assert llm.prefill.abort("s") and not llm.prefill.abort("s")
    assert llm.prefill.step() == [] and not llm.prefill.has_work()
    llm.decode.abort(other, "test over")
    assert not (llm.prefill._held or llm.prefill._lens or llm.prefill._early or llm.prefill._tickets)
    assert llm.prefill.engine.block_manager.num_used_blocks == used
