"""The error classes both lifelines share: a check that ran and failed, a store that failed.

``ValueError`` (and a missing or unreadable path) means the *input* is wrong: the caller
can fix the call. :class:`CheckFailed` means the input was fine and what it points at did
not pass: a damaged checkpoint, no committed checkpoint where one was expected. The CLI
exits 2 on the first and 1 on the second (also on any error raised ``from`` one).
:class:`RemoteStorageError` means the storage itself failed (unreachable, refusing, timing
out after every retry): not the data's fault, and the supervisor probes and restarts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckFailed", "ObjectMismatch", "RemoteStorageError", "is_check_failure"]


class CheckFailed(Exception):
    """A check ran on well-formed input and failed; the message says what failed and where."""


class ObjectMismatch(CheckFailed):
    """Bytes that do not match the size or xxh3-128 checksum recorded for them: a remote
    object shorter, longer or other than its manifest says, or a local file changed before
    upload. Re-fetching may help once (a torn read); a repeat means the copy is damaged."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason

    def __reduce__(self) -> tuple[type[ObjectMismatch], tuple[str, str]]:
        return type(self), (self.url, self.reason)  # survives pickling across processes


class RemoteStorageError(RuntimeError):
    """A remote store failed a request on every attempt (unreachable, timing out, refusing).

    The supervisor classifies it as a ``storage`` fault (probe until healthy, then restart);
    a damaged or missing object is *not* one of these (restarting would not fix it). The
    message names the URL and the cause; ``url`` holds the URL.
    """

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url

    def __reduce__(self) -> tuple[Any, ...]:
        return _remote_storage_error, (type(self), str(self), self.url)


def _remote_storage_error(
    cls: type[RemoteStorageError], message: str, url: str | None
) -> RemoteStorageError:
    return cls(message, url=url)


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
