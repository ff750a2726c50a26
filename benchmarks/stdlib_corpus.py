"""The yardstick model's corpus: the `.py` source of the running Python's standard library.

Every machine with Python has it, so the model can be trained and measured anywhere without a
download. The files are those under `sysconfig.get_paths()["stdlib"]`, minus third-party packages
(`site-packages`, `dist-packages`), the stdlib's own test suites and test data (`test`, `tests`,
`idle_test`), `idlelib` and `lib2to3` (whose test data is Python 2 source), empty files and anything
that cannot be read as UTF-8. Paths are sorted, so every listing is in the same order.

The split is by file: a file is held back when the SHA-1 of its path relative to the stdlib root
falls in 1/20 of the hash space (about 5% of the files). It depends only on the relative path, so
it is the same on every machine and every run for the same Python version, and a held-back file
is never seen in training.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
                          "lib2to3"})
HELDOUT_ONE_IN = 20  # about 5% of the files are held back
FILE_SEPARATOR = "\n\n"  # between files in heldout_text


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_source(path: Path) -> str | None:
    """The file's text, or None when it cannot be read, is not UTF-8 or is empty."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def is_heldout(relative: str) -> bool:
    """Whether the file at `relative` (a POSIX path relative to the stdlib root) is held back."""
    digest = hashlib.sha1(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_ONE_IN == 0


@functools.lru_cache(maxsize=1)
def _corpus_files() -> tuple[tuple[Path, bool], ...]:
    """Every usable source file, sorted by relative path, with whether it is held back."""
    root = stdlib_root()
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if SKIPPED_DIRS.intersection(relative.parts[:-1]) or not path.is_file():
            continue
        if read_source(path) is not None:
            found.append((relative.as_posix(), path))
    found.sort()
    return tuple((path, is_heldout(relative)) for relative, path in found)


def train_files() -> list[Path]:
    """The files the yardstick model is trained on, sorted."""
    return [path for path, held in _corpus_files() if not held]


def heldout_files() -> list[Path]:
    """The held-back files, sorted; none of them is in train_files()."""
    return [path for path, held in _corpus_files() if held]


def heldout_text(max_chars: int | None = None) -> str:
    """The held-back files' text, concatenated in sorted order (FILE_SEPARATOR between files),
    cut to at most `max_chars` characters."""
    parts: list[str] = []
    size = 0
    for path in heldout_files():
        text = read_source(path) or ""
        parts.append(text)
        size += len(text) + len(FILE_SEPARATOR)
        if max_chars is not None and size >= max_chars:
            break
    joined = FILE_SEPARATOR.join(parts)
    return joined if max_chars is None else joined[:max_chars]
