"""Load a checkpoint's tokenizer, if it ships one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: str | Path) -> Any | None:
    """The checkpoint's Hugging Face tokenizer, or None when it has no tokenizer files
    (such a model can still be served with token-id prompts)."""
    from transformers import AutoTokenizer

    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)
