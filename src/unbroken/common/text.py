"""Text from a file made safe to print on a terminal.

A checkpoint manifest, a ``dataset.json`` or an event log is untrusted input: a string in it
could carry ANSI escapes that clear the screen and print a fake "VERIFIED OK", or bidi
overrides that reorder what the reader sees. Everything a command prints from a file goes
through :func:`printable`, which shows such characters as visible escapes instead.
"""

from __future__ import annotations

__all__ = ["printable"]


def _escape(cp: int) -> str:
    return f"\\x{cp:02x}" if cp <= 0xFF else f"\\u{cp:04x}"


# C0 controls, DEL, C1 controls (0x9b is a one-byte CSI), and the bidi embeddings, overrides
# and isolates (U+202A..U+202E, U+2066..U+2069).
_UNSAFE = [
    *range(0x00, 0x20),
    0x7F,
    *range(0x80, 0xA0),
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
]
_ONE_LINE = str.maketrans({cp: _escape(cp) for cp in _UNSAFE})
_MULTI_LINE = str.maketrans({cp: _escape(cp) for cp in _UNSAFE if cp not in (0x09, 0x0A)})


def printable(text: object, *, multiline: bool = False) -> str:
    """``str(text)`` with every control character (and bidi override) written as a visible
    ``\\xNN`` / ``\\uNNNN`` escape. Tabs and newlines are kept only when ``multiline``."""
    return str(text).translate(_MULTI_LINE if multiline else _ONE_LINE)
