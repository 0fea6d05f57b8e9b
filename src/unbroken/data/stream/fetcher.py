"""The per-node download process of a remote dataset: ``python -m unbroken.data.stream.fetcher``.

Started by the first reader of a :class:`~unbroken.data.stream.cache.RemoteCache` that finds none
running, which writes the pickled cache (manifests, order, options; no torch, no transform)
into this process's stdin: a pipe from the parent, never a file others could replace;
holds ``<cache_dir>/.fetch/<dataset>.lock`` while it runs, so there is one per node and
dataset; exits 10 s after the last reader is gone. Downloads run here rather than in the
DataLoader workers because a worker busy decoding holds the GIL and starves the I/O threads
of its own process.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys


class _BoundedStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Log lines to stderr, the cache's ``.fetch/<dataset>.log`` (opened O_APPEND by the
    reader that started this process): emptied before it would pass its bound, so the file
    stays within what the cache limit counts for it."""

    def __init__(self, cap: int) -> None:
        super().__init__(sys.stderr)
        self.cap = cap

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if os.fstat(2).st_size > self.cap // 2:
                os.ftruncate(2, 0)
        except OSError:
            pass  # not a file (a terminal, a pipe): nothing to bound
        super().emit(record)


def main(argv: list[str]) -> int:
    from unbroken.data.stream.cache import _LOG_MAX

    handler = _BoundedStderr(_LOG_MAX)
    handler.setFormatter(logging.Formatter("%(asctime)s fetcher %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    if argv:
        print("usage: python -m unbroken.data.stream.fetcher < PICKLED_CACHE", file=sys.stderr)
        return 2
    payload = sys.stdin.buffer.read()  # all of it first: the parent's writer is not kept waiting
    cache = pickle.loads(payload)  # from RemoteCache._spawn_fetcher, our parent, over a pipe
    cache.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
