"""The one progress-bar factory, for everything a person waits on: pack, index, tokenize,
stage, ckpt verify, ckpt export, archive download.

    with progress_bar("stage", total=need, unit="B", enabled=progress) as bar:
        bar.update(n)                     # from any thread (the caller serialises updates)
        bar.set_postfix_str("3 shards")   # optional detail after the rate

A bar writes to stderr (stdout stays for results and JSON) and only when stderr is a terminal:
in a log file, CI or a test a redrawn line is noise, so off-terminal (or with
``enabled=False``) the factory returns a bar that does nothing. A known ``total`` gives tqdm
its percentage and ETA; bytes and tokens are shown scaled (``1.2GB``, ``3.4Mtok``, powers of
1000 as ``ckpt ls`` prints sizes), counts (shards, steps) as plain integers.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import IO, Any, Protocol

__all__ = ["Progress", "progress_bar"]

_SCALED_UNITS = ("B", "tok")


class Progress(Protocol):
    """What callers use of a bar (tqdm's own names, so a tqdm bar is one)."""

    def update(self, n: float = 1) -> Any: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> Any: ...

    def close(self) -> Any: ...

    def __enter__(self) -> Progress: ...

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> Any: ...


class _Off:
    """The bar when nobody watches: every call is a no-op."""

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Off:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass


def _is_tty(f: IO[str]) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False


def progress_bar(
    desc: str,
    *,
    total: float | None = None,
    unit: str = "B",
    enabled: bool = True,
    file: IO[str] | None = None,
) -> Progress:
    """A tqdm bar labelled ``desc`` counting ``unit`` toward ``total`` (``None``: unknown,
    no ETA), on ``file`` (default: ``sys.stderr`` at call time); a no-op bar when
    ``enabled`` is false or ``file`` is not a terminal."""
    out = sys.stderr if file is None else file
    if not enabled or not _is_tty(out):
        return _Off()
    from tqdm import tqdm

    # tqdm's monitor thread would outlive a fork: pack and tokenize start worker processes.
    tqdm.monitor_interval = 0
    scaled = unit in _SCALED_UNITS
    bar: Progress = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scaled,
        unit_divisor=1000,
        smoothing=0,  # rate and ETA over the whole run: shard-sized steps make a jumpy EWMA
        file=out,
        dynamic_ncols=True,
    )
    return bar
