"""The yardstick model (builtin:stdlib-4m, docs/yardstick.md): its corpus split is deterministic
and disjoint, its shipped checkpoint loads in transformers and in our engine with the same greedy
tokens, and it predicts held-back standard-library source far better than chance."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import stdlib_corpus  # noqa: E402
from benchmarks.yardstick_eval import YARDSTICK, evaluate_checkpoint  # noqa: E402
from engine.builtin_model import PAD_TOKEN_ID, SHIPPED_DIR, resolve_model_path  # noqa: E402
from tests.reference import hf_greedy  # noqa: E402

# Measured on the first 2,000 held-back tokens (the start of Python 3.11's _pydecimal.py): 93.75;
# the limit leaves room for another Python version's files. A random model scores about 4096.
PERPLEXITY_LIMIT = 1.5 * 93.75


def test_the_split_is_deterministic_disjoint_and_not_empty():
    train, held = stdlib_corpus.train_files(), stdlib_corpus.heldout_files()
    assert train and held
    assert not set(train) & set(held)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.10
    stdlib_corpus._corpus_files.cache_clear()  # listed again from the disk: the same files
    assert (stdlib_corpus.train_files(), stdlib_corpus.heldout_files()) == (train, held)
    root = stdlib_corpus.stdlib_root()
    for path in train + held:
        assert not stdlib_corpus.SKIPPED_DIRS & set(path.relative_to(root).parts[:-1])
    text = stdlib_corpus.heldout_text(5000)
    assert len(text) == 5000 and text == stdlib_corpus.heldout_text(5000)
    assert text.startswith(stdlib_corpus.read_source(held[0])[:100])


def test_the_shipped_checkpoint_is_packed_small_and_expands_into_the_cache(tmp_path):
    from safetensors.torch import load_file

    from engine.packed_checkpoint import PACKED_WEIGHTS, expand, pack

    shipped = SHIPPED_DIR / "stdlib-4m"
    assert sum(f.stat().st_size for f in shipped.iterdir()) < 4.5 * 2**20  # the repository's files stay small
    assert not (shipped / "model.safetensors").exists()
    path = resolve_model_path(YARDSTICK)
    assert path != shipped and (path / "model.safetensors").is_file() and resolve_model_path(YARDSTICK) == path
    weights = load_file(path / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    # packing the expanded weights again gives the shipped bytes' values back: int8 rows are exact
    pack(path, tmp_path / "again")
    expand(tmp_path / "again", tmp_path / "twice")
    again = load_file(tmp_path / "twice" / "model.safetensors")
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    assert load_file(shipped / PACKED_WEIGHTS).keys() == load_file(tmp_path / "again" / PACKED_WEIGHTS).keys()


def test_our_engine_is_greedy_as_transformers():
    from pdcluster.llm import LLM, SamplingParams

    path = resolve_model_path(YARDSTICK)
    llm = LLM(YARDSTICK, dtype="float32", num_blocks=16, max_model_len=128)
    try:
        prompt = llm.encode("import os\n\n\ndef read_config(path):\n")
        out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    finally:
        llm.close()
    assert out.token_ids == hf_greedy(str(path), pad_token_id=PAD_TOKEN_ID)(prompt, 24)


def test_it_predicts_held_back_source_far_better_than_chance():
    result = evaluate_checkpoint(resolve_model_path(YARDSTICK), 2000)
    assert result.tokens == 2000
    assert result.perplexity < PERPLEXITY_LIMIT < 4096 / 25
