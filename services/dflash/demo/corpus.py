"""Training corpus for the demo target: the Python standard library's own source.

The corpus needs no downloads: every Python installation ships it. A fixed set of
modules (:data:`HELD_OUT_MODULES`) is never trained on and serves for evaluation.
"""

from __future__ import annotations

import random
import re
import sysconfig
from pathlib import Path
from typing import Literal

Split = Literal["train", "heldout", "unseen"]

#: Stdlib files (relative to the stdlib root) excluded from training and used for
#: held-out loss and evaluation prompts. Chosen to be small, self-contained and
#: typical library code.
HELD_OUT_MODULES: tuple[str, ...] = (
    "json/decoder.py",
    "textwrap.py",
    "heapq.py",
    "fractions.py",
    "shlex.py",
    "bisect.py",
    "colorsys.py",
    "calendar.py",
    "difflib.py",
    "string.py",
    "sched.py",
    "queue.py",
)

MAX_FILE_BYTES = 200_000

# Directory names whose content is tests, tooling or third-party code rather than
# ordinary library source.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "idle_test",
        "__pycache__",
        "turtledemo",
        "config-3",
    }
)

_DEF_RE = re.compile(r"^[ \t]*(?:async[ \t]+def|def|class)[ \t]+\w", re.MULTILINE)


def stdlib_root() -> Path:
    """Return the directory holding the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


# Skipped folders that hold no standard-library code; the other skipped folders (test suites, tools)
# form the "unseen" split: the target never trains on them, so they show how it writes code it has not
# memorised.
_THIRD_PARTY_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _is_skipped(rel: Path) -> bool:
    return any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1])


def _is_unseen(rel: Path) -> bool:
    folders = rel.parts[:-1]
    return _is_skipped(rel) and not any(part in _THIRD_PARTY_DIRS or part.startswith("config-") for part in folders)


def list_files(split: Split = "train", root: Path | None = None) -> list[Path]:
    """List the corpus files of ``split`` in sorted order.

    "train": the target's training files (no site-packages, test/tool folders or held-out modules);
    "heldout": :data:`HELD_OUT_MODULES`; "unseen": the stdlib's test/tool folders, which the target
    never trains on (drafter data only, never evaluation). Files above :data:`MAX_FILE_BYTES` are left out.
    "unseen" includes the test suites of held-out modules (test_heapq.py, test_json/, ...): they call
    those modules but do not contain their source; 113 of the demo build's 6000 unseen prompts come from
    files named like them, and none of the 24 evaluation prompts occurs in any unseen file.
    """
    if split not in ("train", "heldout", "unseen"):
        raise ValueError(f"unknown split {split!r}")
    root = root or stdlib_root()
    if split == "heldout":
        return [root / m for m in HELD_OUT_MODULES if (root / m).is_file()]
    held = set(HELD_OUT_MODULES)
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        in_split = _is_unseen(rel) if split == "unseen" else not _is_skipped(rel)
        if rel.as_posix() in held or not in_split:
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_text(path: Path) -> str:
    """Read a source file as UTF-8, replacing undecodable bytes."""
    return path.read_text(encoding="utf-8", errors="replace")


def load_texts(split: Split = "train", max_files: int | None = None) -> list[str]:
    """Return the texts of ``split`` in :func:`list_files` order (at most ``max_files``)."""
    files = list_files(split)
    if max_files is not None:
        files = files[:max_files]
    return [read_text(p) for p in files]


def _definition_starts(text: str) -> list[int]:
    return [m.start() for m in _DEF_RE.finditer(text)]


def _distinct_prompts(texts: list[str], candidates: list[tuple[int, int]], n: int, prompt_chars: int,
                      seed: int) -> list[str]:
    """The first ``n`` distinct prompts of a seeded shuffle of (text index, start) candidates."""
    rng = random.Random(seed)
    rng.shuffle(candidates)
    prompts: list[str] = []
    seen: set[str] = set()
    for i, start in candidates:
        prompt = texts[i][start : start + prompt_chars]
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
        if len(prompts) == n:
            break
    return prompts


def cut_prompts(texts: list[str], n: int, prompt_chars: int, seed: int) -> list[str]:
    """Cut ``n`` distinct prompts of ``prompt_chars`` characters from ``texts``.

    Each prompt begins at a line holding a ``def``/``class`` statement; the choice
    of start points is a seeded, deterministic shuffle over all files.
    """
    candidates = [
        (i, start)
        for i, text in enumerate(texts)
        for start in _definition_starts(text)
        if start + prompt_chars <= len(text)
    ]
    return _distinct_prompts(texts, candidates, n, prompt_chars, seed)


def line_prompts(texts: list[str], n: int, prompt_chars: int, seed: int) -> list[str]:
    """Cut ``n`` distinct prompts of ``prompt_chars`` characters from ``texts``, each beginning at a
    non-blank line that is NOT a ``def``/``class`` statement (those are :func:`cut_prompts`'), so the
    prompts and the text the target writes after them are new next to the definition-start ones."""
    candidates = []
    for i, text in enumerate(texts):
        definitions = set(_definition_starts(text))
        start = 0
        while start + prompt_chars <= len(text):
            end = text.find("\n", start)
            if text[start:end if end >= 0 else len(text)].strip() and start not in definitions:
                candidates.append((i, start))
            if end < 0:
                break
            start = end + 1
    return _distinct_prompts(texts, candidates, n, prompt_chars, seed)


def heldout_prompts(n: int = 64, prompt_chars: int = 300, seed: int = 0) -> list[str]:
    """Return ``n`` deterministic prompts cut from the held-out modules."""
    return cut_prompts(load_texts("heldout"), n, prompt_chars, seed)


def training_prompts(n: int, prompt_chars: int = 300, seed: int = 0) -> list[str]:
    """Return ``n`` deterministic prompts cut from the training files."""
    return cut_prompts(load_texts("train"), n, prompt_chars, seed)


def midfile_prompts(n: int, prompt_chars: int = 300, seed: int = 0) -> list[str]:
    """Return ``n`` deterministic prompts from mid-file lines of the training and unseen files: text that
    definition-start prompts do not begin with (a line just above a definition overlaps one)."""
    return line_prompts(load_texts("train") + load_texts("unseen"), n, prompt_chars, seed)


def unseen_prompts(n: int, prompt_chars: int = 300, seed: int = 0) -> list[str]:
    """Return ``n`` deterministic prompts cut from stdlib files the target never trained on."""
    return cut_prompts(load_texts("unseen"), n, prompt_chars, seed)
