"""The built-in tiny Llama checkpoint: loads with transformers offline, is deterministic, has a
round-tripping byte-level tokenizer, decisive greedy logits, and is cached by resolve_model_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.builtin_model import (  # noqa: E402
    BOS_TOKEN_ID,
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    UNK_TOKEN_ID,
    resolve_model_path,
    write_builtin_model,
)

EXPECTED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Anything that tried to reach the hub would fail loudly instead of hanging.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    assert write_builtin_model(out) == out
    return out


@pytest.fixture(scope="module")
def loaded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer


def test_constants():
    assert BUILTIN_PREFIX == "builtin:"
    assert "tiny-llama" in BUILTIN_MODELS
    assert (UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID) == (0, 1, 2, 3)


def test_files_and_config(model_dir):
    assert EXPECTED_FILES <= {p.name for p in model_dir.iterdir()}
    cfg = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.model_type == "llama"
    assert cfg.vocab_size == 8192
    assert cfg.hidden_size == 384
    assert cfg.num_hidden_layers == 6
    assert cfg.num_attention_heads == 8
    assert cfg.num_key_value_heads == 4
    assert cfg.intermediate_size == 1024
    assert cfg.max_position_embeddings == 4096
    rope_theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert rope_theta == 10000
    assert cfg.tie_word_embeddings is False
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID)
    gen = transformers.GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    assert (gen.bos_token_id, gen.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)


def test_model_loads(loaded):
    model, _ = loaded
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    assert 10_000_000 <= n_params <= 30_000_000, n_params
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_deterministic(model_dir, tmp_path):
    again = write_builtin_model(tmp_path / "again")
    for name in sorted(p.name for p in model_dir.iterdir()):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert {p.name for p in again.iterdir()} == {p.name for p in model_dir.iterdir()}


def test_tokenizer_specials_and_vocab(loaded):
    _, tok = loaded
    assert len(tok) == 8192
    assert tok.convert_tokens_to_ids(["<unk>", "<s>", "</s>", "<pad>"]) == [0, 1, 2, 3]
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (1, 2, 0, 3)
    # Common words are single tokens, so text is compressed, not spelled out byte by byte.
    ids = tok("the model and the server", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The model runs on the server.",
        "Café naïve résumé — Zürich, São Paulo, Ångström",
        "東京 中文 😀🚀👍🏽 👨‍👩‍👧",
        "  leading spaces\n\ttabs and\r\n newlines  ",
        "x = 3.14159 * (r ** 2)  # <|user|> looking text",
        "",
    ],
)
def test_tokenizer_round_trip(loaded, text):
    _, tok = loaded
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_TOKEN_ID
    assert ids.count(BOS_TOKEN_ID) == 1
    assert UNK_TOKEN_ID not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_special_token_text_is_parsed_as_special(loaded):
    # Standard Hugging Face behaviour: special-token strings in the text become those tokens.
    _, tok = loaded
    ids = tok("a </s> b", add_special_tokens=False)["input_ids"]
    assert EOS_TOKEN_ID in ids
    assert tok.decode(ids) == "a </s> b"


def test_chat_template(loaded):
    _, tok = loaded
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi 👋\n<|assistant|>\n"
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|system|>\nBe brief.\n<|user|>\nHi 👋\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_TOKEN_ID
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_greedy_generate_is_decisive(loaded):
    model, tok = loaded
    # The model is deterministic, so this prompt's first-step gap is a fixed number (~1.5); the
    # statistics over many positions below are what show lm_head was scaled.
    inputs = tok("Once upon a time", return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() > 0.5
    new = out[0, prompt_len:].tolist()
    assert len(new) == 8
    assert new[0] == int(logits.argmax())
    assert all(0 <= t < 8192 for t in new)
    assert isinstance(tok.decode(new), str)
    with torch.no_grad():  # greedy is reproducible
        again = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(out, again)


def test_logits_are_decisive(loaded):
    model, tok = loaded
    text = " ".join(["The server sends a request to the model, and the model answers quickly."] * 4)
    ids = tok(text, return_tensors="pt")["input_ids"]
    g = torch.Generator().manual_seed(0)
    random_ids = torch.randint(4, 8192, (1, 128), generator=g)
    for batch in (ids, random_ids):
        with torch.no_grad():
            logits = model(batch).logits[0]
        top2 = logits.topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        # Unscaled (std-0.02 init) these would be ~0.05 and ~1/8192.
        assert gaps.median().item() > 0.3
        assert logits.softmax(-1).max(-1).values.median().item() > 0.1


def test_resolve_builtin_writes_once(monkeypatch, tmp_path):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    path = resolve_model_path("builtin:tiny-llama")
    assert path == tmp_path / "builtin" / "tiny-llama-v1"
    assert EXPECTED_FILES <= {p.name for p in path.iterdir()}
    # Nothing left behind but the entry itself (and its lock file).
    leftovers = [p.name for p in (tmp_path / "builtin").iterdir() if p != path and not p.name.endswith(".lock")]
    assert leftovers == []
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert resolve_model_path("builtin:tiny-llama") == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes
    assert (path / "config.json").is_file()


def _fake_writer(marker: str):
    def write(out, name="tiny-llama"):
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / f).write_text(marker)
        return out

    return write


def test_resolve_lost_rename_race_uses_winner(monkeypatch, tmp_path):
    import engine.builtin_model as bm

    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    target = tmp_path / "builtin" / "tiny-llama-v1"
    fake = _fake_writer("ours")

    def write_while_another_process_wins(out, name="tiny-llama"):
        _fake_writer("theirs")(target, name)  # a writer that did not take the lock
        return fake(out, name)

    monkeypatch.setattr(bm, "write_builtin_model", write_while_another_process_wins)
    assert resolve_model_path("builtin:tiny-llama") == target
    assert (target / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in target.parent.iterdir()) == [".tiny-llama-v1.lock", "tiny-llama-v1"]


def test_resolve_replaces_incomplete_entry(monkeypatch, tmp_path):
    import engine.builtin_model as bm

    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    target = tmp_path / "builtin" / "tiny-llama-v1"
    target.mkdir(parents=True)
    (target / "config.json").write_text("partial")
    monkeypatch.setattr(bm, "write_builtin_model", _fake_writer("fresh"))
    assert resolve_model_path("builtin:tiny-llama") == target
    assert (target / "model.safetensors").read_text() == "fresh"
    assert sorted(p.name for p in target.parent.iterdir()) == [".tiny-llama-v1.lock", "tiny-llama-v1"]


def test_resolve_default_cache_dir(monkeypatch, tmp_path):
    import engine.builtin_model as bm

    monkeypatch.delenv("PDCLUSTER_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bm.cache_root() == tmp_path / ".cache" / "pdcluster"


def test_resolve_unknown_builtin(monkeypatch, tmp_path):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="tiny-llama") as err:
        resolve_model_path("builtin:no-such-model")
    assert "no-such-model" in str(err.value)
    assert not (tmp_path / "builtin" / "no-such-model-v1").exists()


def test_resolve_local_paths(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="not found") as err:
        resolve_model_path(missing)
    assert repr(missing) in str(err.value)
    assert "config.json missing" in str(err.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json missing"):
        resolve_model_path(str(empty))

    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    with pytest.raises(ValueError, match="not a Hugging Face checkpoint directory"):
        resolve_model_path(str(a_file))

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert resolve_model_path(str(ckpt)) == ckpt
    assert os.path.samefile(resolve_model_path(str(ckpt) + "/"), ckpt)


def test_realistic_model_spec():
    """builtin:llama-200m: the shape performance is measured on, a bfloat16 checkpoint (written
    by tests/integration/test_builtin_realistic.py, which is slow: 411 MB)."""
    from planner.models import ModelShape

    spec, tiny = BUILTIN_MODELS["llama-200m"], BUILTIN_MODELS["tiny-llama"]
    c = spec["config"]
    assert spec["dtype"] == "bfloat16" and "dtype" not in tiny
    shape = ModelShape("llama-200m", c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                       c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"])
    assert (shape.num_layers, shape.hidden_size, shape.intermediate_size, shape.head_dim) == (16, 1024, 2816, 64)
    assert (shape.num_heads, shape.num_kv_heads, shape.vocab_size) == (16, 8, 8192)
    assert shape.params == 205_554_688
    # the same tokenizer and initialisation as the tiny model; only the layer sizes differ
    assert {k: v for k, v in spec.items() if k not in ("config", "dtype")} == {k: v for k, v in tiny.items() if k != "config"}
    assert tiny["config"]["hidden_size"] == 384  # deriving one spec did not touch the other
