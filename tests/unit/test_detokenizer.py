"""IncrementalDetokenizer with the built-in byte-level BPE tokenizer: multi-byte characters split
across tokens, special tokens, and stop strings."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from engine.builtin_model import EOS_TOKEN_ID, resolve_model_path
from engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
MULTIBYTE_TEXT = "Café naïve — 日本語の中文 😀👍🚀 résumé Straße 🤖 end."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    saved = {k: os.environ.get(k) for k in ("PDCLUSTER_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["PDCLUSTER_CACHE"] = str(tmp_path_factory.mktemp("pdcluster-cache"))
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        path = resolve_model_path("builtin:tiny-llama")
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Deltas returned by add(), one per token."""
    return [detok.add(t) for t in ids]


def full_decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# Incremental decoding
# ---------------------------------------------------------------------------------------------


def test_fixture_text_really_splits_characters_across_tokens(tokenizer):
    ids = encode(tokenizer, MULTIBYTE_TEXT)
    assert full_decode(tokenizer, ids) == MULTIBYTE_TEXT
    partial = [t for t in ids if REPLACEMENT in tokenizer.decode([t])]
    assert len(partial) >= 5  # byte-level tokens that end inside a character


@pytest.mark.parametrize("prompt", ["", "Hello there", "日本"])
def test_incremental_equals_full_decode_for_multibyte_text(tokenizer, prompt):
    ids = encode(tokenizer, MULTIBYTE_TEXT)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt))
    deltas = feed(detok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == full_decode(tokenizer, ids) == MULTIBYTE_TEXT
    assert "".join(deltas) == MULTIBYTE_TEXT  # without stop strings nothing is held back
    assert not detok.stopped


def test_text_is_emitted_as_soon_as_a_character_is_complete(tokenizer):
    ids = encode(tokenizer, MULTIBYTE_TEXT)
    detok = IncrementalDetokenizer(tokenizer, [])
    emitted = ""
    for k, t in enumerate(ids, start=1):
        emitted += detok.add(t)
        so_far = full_decode(tokenizer, ids[:k])
        if so_far.endswith(REPLACEMENT):  # an incomplete character is held back
            assert so_far.startswith(emitted) and REPLACEMENT not in emitted
        else:  # otherwise everything decoded so far is out
            assert emitted == so_far


@given(
    text=st.text(
        alphabet=st.sampled_from([*"abc xyz.,\n", "é", "ß", "ñ", "—", "€", "日", "本", "中", "😀", "👍", "🚀", "🤖"]),
        max_size=40,
    ),
    prompt=st.text(alphabet=st.sampled_from(list("ab ") + ["é", "日", "😀"]), max_size=8),
)
@settings(max_examples=60, deadline=None)
def test_incremental_equals_full_decode_property(tokenizer, text, prompt):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt))
    deltas = feed(detok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text


def test_special_tokens_are_skipped(tokenizer):
    ids = encode(tokenizer, "one 日本") + [EOS_TOKEN_ID] + encode(tokenizer, " two 😀")
    detok = IncrementalDetokenizer(tokenizer, [1])
    deltas = feed(detok, ids)
    assert "".join(deltas) + detok.flush() == full_decode(tokenizer, ids) == "one 日本 two 😀"


def test_leading_space_of_first_output_token_is_kept(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hello"))
    ids = encode(tokenizer, " world")
    assert "".join(feed(detok, ids)) == " world"


# ---------------------------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------------------------


def run_with_stop(tokenizer, text: str, stop: list[str]) -> tuple[str, IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, [], stop)
    deltas = []
    for t in encode(tokenizer, text):
        deltas.append(detok.add(t))
        if detok.stopped:
            break
    out = "".join(deltas) + detok.flush()
    assert all(REPLACEMENT not in d for d in deltas)
    return out, detok, deltas


def test_output_is_truncated_before_the_stop_string(tokenizer):
    out, detok, _ = run_with_stop(tokenizer, "The quick brown fox jumps over the lazy dog", ["lazy"])
    assert out == "The quick brown fox jumps over the "
    assert detok.stopped


def test_earliest_stop_string_wins_among_those_found_together(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    out, detok, _ = run_with_stop(tokenizer, text, ["lazy dog", "fox", "quick brown fox"])
    assert out == "The " and detok.stopped  # "fox" and "quick brown fox" complete with the same token
    out, _, _ = run_with_stop(tokenizer, "The quick brown fox", ["fox", "brown fox"])
    assert out == "The quick "


def test_first_completed_stop_string_ends_generation(tokenizer):
    # "over" completes before the longer, earlier-starting stop string could: generation stops there.
    text = "The quick brown fox jumps over the lazy dog"
    out, detok, _ = run_with_stop(tokenizer, text, ["over", "jumps over the lazy"])
    assert out == "The quick brown fox jumps " and detok.stopped


def test_stop_string_spanning_several_tokens_is_found(tokenizer):
    stop = " jumps over the"
    assert len(encode(tokenizer, stop)) >= 3
    out, detok, _ = run_with_stop(tokenizer, "The quick brown fox jumps over the lazy dog", [stop])
    assert out == "The quick brown fox" and detok.stopped


def test_multibyte_stop_string_split_across_byte_tokens_is_found(tokenizer):
    stop = "語の"
    text = "日本語の中文 😀"
    assert any(REPLACEMENT in tokenizer.decode([t]) for t in encode(tokenizer, text))
    out, detok, _ = run_with_stop(tokenizer, text, [stop])
    assert out == "日本" and detok.stopped
    out, detok, _ = run_with_stop(tokenizer, "ok 👍🚀 rest", ["🚀"])
    assert out == "ok 👍" and detok.stopped


def test_stop_string_at_the_very_start_gives_empty_output(tokenizer):
    out, detok, deltas = run_with_stop(tokenizer, "STOP and more", ["STOP"])
    assert out == "" and detok.stopped and all(d == "" for d in deltas)


def test_nothing_is_emitted_after_stopping(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ["fox"])
    text = ""
    for t in encode(tokenizer, "brown fox jumps over"):
        text += detok.add(t)
    assert detok.stopped
    assert text == "brown "
    assert detok.add(encode(tokenizer, " more")[0]) == ""
    assert detok.flush() == ""


def test_text_is_held_back_while_a_stop_string_could_still_be_forming(tokenizer):
    stop = ["STOP", "xy"]
    held = max(len(s) for s in stop) - 1
    text = "Hello wonderful world, how are things today"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop)
    emitted = ""
    for k, t in enumerate(ids, start=1):
        emitted += detok.add(t)
        so_far = full_decode(tokenizer, ids[:k])
        assert emitted == so_far[: max(0, len(so_far) - held)]
    assert not detok.stopped
    assert emitted + detok.flush() == text


def test_partial_stop_string_at_the_end_is_released_by_flush(tokenizer):
    out_deltas = []
    detok = IncrementalDetokenizer(tokenizer, [], ["STOP"])
    for t in encode(tokenizer, "almost a STO"):
        out_deltas.append(detok.add(t))
    emitted = "".join(out_deltas)
    assert not emitted.endswith("STO") and not detok.stopped
    rest = detok.flush()
    assert emitted + rest == "almost a STO" and rest.endswith("STO")
    assert detok.flush() == ""  # flushing twice releases nothing more


def test_stop_string_found_in_the_held_back_text_only_after_it_completes(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ["END!"])
    emitted = ""
    for t in encode(tokenizer, "abc EN"):
        emitted += detok.add(t)
    assert not detok.stopped
    for t in encode(tokenizer, "D! tail"):
        emitted += detok.add(t)
        if detok.stopped:
            break
    assert detok.stopped and emitted + detok.flush() == "abc "


def test_no_stop_strings_hold_nothing_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    out = "".join(feed(detok, encode(tokenizer, "plain text")))
    assert out == "plain text" and detok.flush() == ""


def test_no_stop_string_matches_in_the_first_min_tokens_tokens(tokenizer):
    ids = encode(tokenizer, "fox and fox again")
    first = len(encode(tokenizer, "fox"))
    detok = IncrementalDetokenizer(tokenizer, [], ["fox"], min_tokens=first)
    text = "".join(detok.add(t) for t in ids)
    assert detok.stopped and text == "fox and "  # the first "fox" is inside min_tokens: not a stop
    plain = IncrementalDetokenizer(tokenizer, [], ["fox"])
    assert "".join(plain.add(t) for t in ids) == "" and plain.stopped
