"""The one error class both lifelines share: a check that ran and failed.

``ValueError`` (and a missing or unreadable path) means the *input* is wrong: the caller
can fix the call. :class:`CheckFailed` means the input was fine and what it points at did
not pass: a damaged checkpoint, no committed checkpoint where one was expected. The CLI
exits 2 on the first and 1 on the second (also on any error raised ``from`` one).
"""

from __future__ import annotations

__all__ = ["CheckFailed", "is_check_failure"]


class CheckFailed(Exception):
    """A check ran on well-formed input and failed; the message says what failed and where."""


def is_check_failure(e: BaseException) -> bool:
    """``e`` is a :class:`CheckFailed`, or was raised ``from`` one (``raise X from e``)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, CheckFailed):
            return True
        seen.add(id(cur))
        cur = cur.__cause__
    return False
