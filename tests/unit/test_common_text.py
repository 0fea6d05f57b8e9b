"""Strings from files are printed with their control characters escaped (issue 20 item 11)."""

from __future__ import annotations

from unbroken.common.text import printable


def test_ansi_escape_and_carriage_return_are_made_visible() -> None:
    forged = "step-3\x1b[2J\x1b[HVERIFIED OK\r"
    out = printable(forged)
    assert "\x1b" not in out and "\r" not in out
    assert out == "step-3\\x1b[2J\\x1b[HVERIFIED OK\\x0d"


def test_c1_csi_del_and_bidi_overrides_are_escaped() -> None:
    assert printable("a\x9b2Jb\x7f") == "a\\x9b2Jb\\x7f"
    assert printable("x\u202ey\u2066") == "x\\u202ey\\u2066"


def test_newlines_kept_only_when_multiline() -> None:
    assert printable("a\nb\tc") == "a\\x0ab\\x09c"
    assert printable("a\nb\tc", multiline=True) == "a\nb\tc"


def test_plain_text_and_non_strings_pass_through() -> None:
    assert printable("step-00000012  1.2 MiB  é ü 中") == "step-00000012  1.2 MiB  é ü 中"
    assert printable(42) == "42"
