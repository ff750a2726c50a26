"""Every way through the engine gives the same tokens: chunked prefill, prefix-cache hits,
preemption with recompute, seeded sampling, colocated (mixed steps) or disaggregated; and bad input
is refused with a clear ValueError."""

from __future__ import annotations

import json

import pytest
import torch

from pdcluster import LLM, SamplingParams
from pdcluster.llm import MODES
from tests.checkpoints import VOCAB

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _prompts(lens, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def _ids(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module", params=["llama-gqa", "deepseek-v3"])
def path(checkpoint, request):
    """A dense model, and latent attention with routed experts (its prefill expands the latents of
    new and cached tokens alike; decode attends to them as they are)."""
    return str(checkpoint(request.param))


@pytest.fixture(scope="module")
def reference(path):
    """Unchunked, no prefix caching, roomy cache, one prompt at a time through the disaggregated
    path: the baseline every other path must equal."""
    def run(prompts, params=GREEDY):
        llm = LLM(path, num_blocks=256, max_model_len=256, enable_prefix_caching=False, mode="disaggregated")
        return [_ids(llm.generate([p], params))[0] for p in prompts]
    return run


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def _used_blocks(llm):
    return sum(e.block_manager.num_used_blocks for e in llm.engines)


def test_chunked_prefill_equals_unchunked(path, reference, mode):
    prompts = _prompts([70, 45, 9, 100])
    llm = LLM(path, num_blocks=256, max_model_len=256, max_num_batched_tokens=16, max_num_seqs=16, mode=mode)
    assert _ids(llm.generate(prompts, GREEDY)) == reference(prompts)


def test_mixed_steps_batch_decode_rows_with_prompt_chunks(path, reference):
    """Colocated: a long prompt is prefilled in chunks while the short ones already generate, in
    the same forward passes, and every output still equals the one-at-a-time reference."""
    prompts = _prompts([9, 12, 200])
    llm = LLM(path, num_blocks=256, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=16,
              mode="colocated")
    engine, shapes = llm.engine, []
    step = engine.step

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        if engine.last_step is not None:
            shapes.append((engine.last_step.seqs, engine.last_step.tokens))
        return out

    engine.step = recording_step
    prepare, metas = engine.runner._prepare, []

    def recording_prepare(batch):
        out = prepare(batch)
        metas.append(out[2][None])
        return out

    engine.runner._prepare = recording_prepare
    assert _ids(llm.generate(prompts, GREEDY)) == reference(prompts)
    # steps with the two short prompts decoding (2 rows) and a 30-token chunk of the long one
    assert (3, 32) in shapes, shapes
    mixed = [m for m in metas if m.spans and (m.native_decode is not None or m.spans[0].q_end - m.spans[0].q_start == 1)]
    assert mixed, "no step batched decode rows with a prompt chunk"
    if engine.runner.native_decode:  # the mixed step's decode rows went to the native kernel, the chunk to spans
        m = next(m for m in metas if m.native_decode is not None and m.spans)
        assert len(m.native_decode.context_lens) == m.spans[0].q_start == 2
    assert _used_blocks(llm) == 0


def test_prefix_cache_hit_equals_miss(path, reference, mode):
    shared = _prompts([48])[0]
    tails = _prompts([5, 13, 21], seed=4)
    prompts = [shared + t for t in tails]
    llm = LLM(path, num_blocks=256, max_model_len=256, block_size=16, mode=mode)
    first = llm.generate(prompts[:1], GREEDY)
    assert first[0].num_cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY)
    assert all(o.num_cached_tokens == 48 for o in rest), [o.num_cached_tokens for o in rest]
    again = llm.generate(prompts[:1], GREEDY)  # the very same prompt: every full block but the last hits
    assert again[0].num_cached_tokens == 48
    assert _ids(first) + _ids(rest) == reference(prompts)
    assert _ids(again) == _ids(first)


def test_preemption_and_resumption_give_the_same_tokens(path, reference, mode):
    prompts = _prompts([40, 38, 36, 34, 30])
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    # 5 sequences of ~100 tokens need ~35 blocks of 16; the decode cache has 16: decode must preempt.
    llm = LLM(path, num_blocks=16, max_model_len=128, mode=mode)
    outs = llm.generate(prompts, params)
    assert sum(e.scheduler.num_preemptions for e in llm.engines) > 0
    assert _ids(outs) == reference(prompts, params)
    assert _used_blocks(llm) == 0


def test_same_seed_gives_same_sampled_tokens_whatever_the_batch(path, mode):
    llm = LLM(path, num_blocks=256, max_model_len=256, mode=mode)
    prompts = _prompts([10, 30, 50])
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = llm.generate(prompts[1:2], seeded)[0].token_ids
    batched = llm.generate(prompts, [GREEDY, seeded, SamplingParams(max_tokens=8, temperature=1.0)])[1].token_ids
    assert alone == batched
    other = llm.generate(prompts[1:2], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99))
    assert other[0].token_ids != alone


def test_stop_token_ids_max_tokens_and_eos(path):
    llm = LLM(path, num_blocks=256, max_model_len=256)
    prompt = _prompts([12])[0]
    free = llm.generate([prompt], GREEDY)[0].token_ids
    stop_at = free[5]
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: free.index(stop_at) + 1] and out.finish_reason == "stop"
    one = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert one.token_ids == free[:1] and one.finish_reason == "length"


def test_stop_string_truncates_text(builtin_path, mode):
    llm = LLM("builtin:tiny-llama", num_blocks=64, max_model_len=512, mode=mode)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = llm.generate("Once upon a time", params)[0]
    assert len(full.text) > 10
    stop = full.text[6:9]
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                          stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert _used_blocks(llm) == 0


def test_logprobs_are_returned_when_asked(path):
    llm = LLM(path, num_blocks=256, max_model_len=256)
    out = llm.generate(_prompts([8]), SamplingParams(max_tokens=5, temperature=0.0, logprobs=4))[0]
    assert len(out.logprobs) == len(out.token_ids) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 4 and lp.top[0][0] == tok
        assert lp.logprob == pytest.approx(lp.top[0][1])


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], GREEDY, "prompt is empty"),
        ([5] * 256, GREEDY, "max_model_len"),
        ([5, VOCAB], GREEDY, "outside the vocabulary"),
        ([5, -1], GREEDY, "outside the vocabulary"),
        ("text", GREEDY, "no tokenizer"),
    ],
)
def test_bad_requests_raise_value_error(path, prompt, params, message, mode):
    llm = LLM(path, num_blocks=64, max_model_len=256, mode=mode)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    assert _ids(llm.generate([[5, 6, 7]], GREEDY))  # still serves the next request


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path_and_unsupported_architecture(tmp_path, path):
    with pytest.raises(ValueError, match="not found|config.json"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="known|builtin"):
        LLM("builtin:no-such-model")
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(bad))


def test_kv_cache_too_small_for_max_model_len_is_refused(path):
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(path, num_blocks=4, block_size=16, max_model_len=256)


def test_int8_kv_compression_keeps_greedy_output_on_a_decisive_model(path, reference):
    prompts = _prompts([30, 64, 90])
    llm = LLM(path, num_blocks=256, max_model_len=256, kv_compression="int8", mode="disaggregated")
    assert _ids(llm.generate(prompts, GREEDY)) == reference(prompts)
    with pytest.raises(ValueError, match="allowed: none, int8"):
        LLM(path, num_blocks=64, max_model_len=256, kv_compression="zstd", mode="disaggregated")
    with pytest.raises(ValueError, match="mode='disaggregated'"):
        LLM(path, num_blocks=64, max_model_len=256, kv_compression="int8")
    with pytest.raises(ValueError, match="mode must be one of"):
        LLM(path, num_blocks=64, max_model_len=256, mode="split")
