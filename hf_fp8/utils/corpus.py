"""A real English corpus on every machine: docstrings of the Python standard library."""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from pathlib import Path

_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def stdlib_sentences(n: int = 256, *, seed: int = 0, min_words: int = 6) -> list[str]:
    """``n`` distinct English sentences from stdlib docstrings, in a seeded order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    seen: set[str] = set()
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                continue
            doc = ast.get_docstring(node) or ""
            for para in doc.split("\n\n"):
                text = " ".join(para.split())
                for sentence in _SENTENCE.split(text):
                    words = sentence.split()
                    if len(words) >= min_words and sentence[0].isupper() and sentence not in seen:
                        seen.add(sentence)
                        found.append(sentence)
    random.Random(seed).shuffle(found)
    if len(found) < n:
        raise RuntimeError(f"only {len(found)} stdlib sentences found, {n} asked for")
    return found[:n]


def stdlib_source_text(max_chars: int = 2_000_000) -> str:
    """Concatenated stdlib source files (a code corpus for language-model training)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(parts)[:max_chars]
