"""Text read from a checkpoint, made safe to print on a terminal (standard library only).

Tensor names, ``config.json`` values and the messages that quote them come from whoever wrote
the checkpoint: an escape sequence in a tensor name clears the screen or colours the output,
a newline forges a line of ``hf-fp8 inspect``'s report (R41 F2). :func:`printable` escapes
what can move the cursor, forge a line or reorder the text (C0 / C1 controls such as ESC, CR,
newline; line and paragraph separators; the bidirectional marks, overrides and isolates such as
the right-to-left override; surrogates) the way ``repr`` writes it: ``\\x1b``, ``\\n``,
``\\u202e``. Everything else stays as it is, as it belongs in real names (R43 F3): spaces of
every script (U+3000, U+00A0), the zero-width joiners of Persian words and emoji sequences,
``×``, ``→``; a backslash stays a single backslash. ``--json`` output needs none of this (JSON
escapes).
"""

from __future__ import annotations

import unicodedata

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
# bidirectional marks, embeddings, overrides and isolates (they reorder what follows them)
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _unsafe(char: str) -> bool:
    return char in _BIDI or unicodedata.category(char) in _UNSAFE_CATEGORIES


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: object) -> str:
    """``str(text)`` with controls, line separators and bidirectional controls escaped as
    ``repr`` does (``"a\\x1b[2Jb"`` → ``"a\\\\x1b[2Jb"``); other text comes back unchanged."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(_escape(c) if _unsafe(c) else c for c in text)
