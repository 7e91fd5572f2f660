"""Text read from a checkpoint, made safe to print on a terminal (standard library only).

Tensor names, ``config.json`` values and the messages that quote them come from whoever wrote
the checkpoint: an escape sequence in a tensor name clears the screen or colours the output,
a newline forges a line of ``hf-fp8 inspect``'s report (R41 F2). :func:`printable` escapes
every character ``str.isprintable`` rejects (C0 / C1 controls such as ESC, CR, newline; format
characters such as the right-to-left override; line and paragraph separators; unassigned and
private-use code points) the way ``repr`` writes it: ``\\x1b``, ``\\n``, ``\\u202e``. The
space and every other printable character (``×``, ``→``, non-Latin names) stay as they are;
a backslash stays a single backslash. ``--json`` output needs none of this (JSON escapes).
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


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
    """``str(text)`` with every character that is not printable escaped as ``repr`` does
    (``"a\\x1b[2Jb"`` → ``"a\\\\x1b[2Jb"``); printable text comes back unchanged."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)
