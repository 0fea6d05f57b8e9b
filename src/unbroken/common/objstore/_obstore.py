"""The obstore backend: S3, GCS, Azure and HTTP(S) through the Rust ``object_store`` crate.

obstore's *sync* API is used: each call releases the GIL while Rust does the request on its
own runtime. A download's body is streamed (``GetResult.stream``) in buffers of about
``part_bytes``, each hashed and ``pwrite``-n without a copy in Python: one GET of any length
holds at most one buffer. Measured against its async API (``benchmarks/objstore_get.py``), a sync call
costs less per GET from a plain thread: no event loop to enter, no future to hand between
threads; the threads that fetch parts in parallel are the concurrency. Throttling (503
SlowDown, 429), 5xx replies, dropped connections and timeouts are retried inside obstore
(``StoreOptions.retries``, backoff with jitter); what still fails is a
:class:`~unbroken.common.errors.RemoteStorageError` naming the URL and obstore's reason.

obstore runs every request on one tokio runtime per process, which does not survive
``fork``: a forked child of a process that has used obstore hangs in its first request
(measured: obstore 0.12.1). Such a child (a DataLoader worker forked after the main process
fetched) is served by fsspec instead, with one warning; a spawned process, or a fork taken
before any obstore request, uses obstore.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from unbroken.common.errors import RemoteStorageError
from unbroken.common.objstore.base import ObjectStore, PastEnd, missing_container
from unbroken.common.objstore.options import Route, StoreOptions

if TYPE_CHECKING:
    from obstore import GetOptions

__all__ = ["ObstoreStore", "runtime_here"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_runtime_pid: int | None = None  # the process whose obstore runtime has run a request


def runtime_here() -> bool:
    """Whether this process has run an obstore request (a child it forks could not use
    obstore: see the module docstring)."""
    return _runtime_pid == os.getpid()


def _reason(e: BaseException) -> str:
    """obstore's message without its multi-line debug dump."""
    text = str(e).split("\n\nDebug source", 1)[0].strip()
    return " ".join(text.split())[:600]


class ObstoreStore(ObjectStore):
    """An :class:`ObjectStore` on obstore (see the module docstring)."""

    kind = "obstore"

    def __init__(
        self,
        url: str,
        options: StoreOptions,
        route: Route,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(url, options)
        self._route = route
        self._so = dict(storage_options or {})
        self._fallback: ObjectStore | None = None
        self._store: Any = None
        self._store_pid = -1
        self._store_lock = threading.Lock()
        self._obs()  # a bad configuration is refused here, naming the URL, not at first use

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d.update(_store=None, _store_pid=-1, _store_lock=None, _fallback=None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        super().__setstate__(d)
        self._store_lock = threading.Lock()

    def _obs(self) -> Any:
        """This process's obstore store (a forked child builds its own: the runtime and the
        connection pool of the parent do not survive a fork)."""
        if self._store is not None and self._store_pid != os.getpid():
            # a forked child: the parent's lock may have been held by a thread that is gone
            self._store, self._store_lock = None, threading.Lock()
        with self._store_lock:
            if self._store is None or self._store_pid != os.getpid():
                from obstore.store import from_url

                r = self._route
                kw: dict[str, Any] = dict(client_options=r.client, retry_config=r.retry)
                if r.config:
                    kw["config"] = r.config
                try:
                    self._store = from_url(self.url, **kw)
                except Exception as e:
                    raise ValueError(
                        f"{self.url}: cannot configure obstore for it ({_reason(e)}); fix the "
                        "storage_options / environment, or pass StoreOptions(client='fsspec')"
                    ) from e
                self._store_pid = os.getpid()
            return self._store

    def _forked(self) -> ObjectStore | None:
        """The fsspec store that serves this process when it was forked from one whose
        obstore runtime ran (see the module docstring); None where obstore works."""
        if _runtime_pid is None or _runtime_pid == os.getpid():
            return None
        if self._fallback is None or getattr(self._fallback, "_fs_pid", None) != os.getpid():
            from unbroken.common.objstore._fsspec import FsspecStore

            log.warning(
                "%s: this process (pid %d) was forked from one that used obstore, whose "
                "runtime does not survive a fork; fsspec serves it here (slower). Start "
                "workers with the 'spawn' or 'forkserver' method to keep obstore",
                self.url,
                os.getpid(),
            )
            self._fallback = FsspecStore(self.url, self.options, self._so)
        return self._fallback

    def _call(self, what: str, key: str, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(store)``; obstore's errors become ours, naming the URL."""
        from obstore.exceptions import BaseError, NotFoundError

        global _runtime_pid
        url = self.url_of(key)
        _runtime_pid = os.getpid()
        try:
            return fn(self._obs())
        except (NotFoundError, FileNotFoundError) as e:
            raise FileNotFoundError(f"{url}: no such object") from e
        except BaseError as e:
            reason = _reason(e)
            if "416" in reason and "Range Not Satisfiable" in reason:
                raise PastEnd(reason) from None
            raise RemoteStorageError(
                f"{url}: {what} failed ({type(e).__name__}: {reason}); the storage is "
                "unreachable, refusing or failing - check the endpoint, credentials and "
                "network, then re-run",
                url=url,
            ) from e

    def _range(self, key: str, start: int, end: int) -> Any:
        if (fb := self._forked()) is not None:
            return fb._range(key, start, end)
        import obstore

        return self._call(
            "ranged GET", key, lambda s: obstore.get_range(s, key, start=start, end=end)
        )

    def _stream(self, key: str, start: int, end: int) -> Iterator[Any]:
        if (fb := self._forked()) is not None:
            yield from fb._stream(key, start, end)
            return
        import obstore

        opts: GetOptions = {"range": (start, end)}
        res = self._call("ranged GET", key, lambda s: obstore.get(s, key, options=opts))
        # at least half a part per buffer: obstore joins the network's chunks up to this
        # size, and may overshoot it by one of them
        chunks = iter(res.stream(min_chunk_size=max(self.options.part_bytes // 2, 1)))
        while (buf := self._call("ranged GET", key, lambda s: next(chunks, None))) is not None:
            yield buf

    def head(self, key: str) -> int | None:
        if (fb := self._forked()) is not None:
            return fb.head(key)
        import obstore

        try:
            meta = self._call("HEAD", key, lambda s: obstore.head(s, key))
        except FileNotFoundError:
            return None
        return int(meta["size"])

    def list_objects(self, prefix: str = "") -> dict[str, int]:
        if (fb := self._forked()) is not None:
            return fb.list_objects(prefix)
        import obstore

        def ls(s: Any) -> dict[str, int]:
            out: dict[str, int] = {}
            for chunk in obstore.list(s, prefix.strip("/") or None, chunk_size=1000):
                for m in chunk:
                    out[m["path"]] = int(m["size"])
            return out

        return self._listing(prefix, ls)

    def list_dirs(self, prefix: str = "") -> list[str]:
        if (fb := self._forked()) is not None:
            return fb.list_dirs(prefix)
        import obstore

        base = prefix.strip("/")

        def ls(s: Any) -> list[str]:
            # object_store pages through the whole level (every continuation token) itself
            res = obstore.list_with_delimiter(s, base or None)
            n = len(base) + 1 if base else 0
            return sorted(p.rstrip("/")[n:] for p in res["common_prefixes"])

        return self._listing(prefix, ls)

    def _listing(self, prefix: str, ls: Callable[[Any], _T]) -> _T:
        """``ls(store)``; a bucket (container) that does not exist said so, not a failure."""
        try:
            return self._call("listing", prefix, ls)
        except RemoteStorageError as e:
            missing = missing_container(self.url, str(e))
            if missing is None:
                raise
            raise missing from None

    def delete(self, keys: list[str]) -> None:
        if (fb := self._forked()) is not None:
            return fb.delete(keys)
        import obstore

        if keys:
            try:
                self._call("delete", keys[0], lambda s: obstore.delete(s, keys))
            except FileNotFoundError:
                pass  # a store that reports a missing key: already gone

    def put_bytes(self, key: str, data: bytes) -> None:
        if (fb := self._forked()) is not None:
            return fb.put_bytes(key, data)
        import obstore

        self._call("PUT", key, lambda s: obstore.put(s, key, data, use_multipart=False))

    def _put_stream(self, key: str, chunks: Iterator[bytes], size: int) -> None:
        if (fb := self._forked()) is not None:
            return fb._put_stream(key, chunks, size)
        import obstore

        o = self.options
        self._call(
            "multipart PUT",
            key,
            lambda s: obstore.put(
                s,
                key,
                chunks,
                use_multipart=True,
                # S3 takes at most 10,000 parts: a file beyond 80 GB gets larger ones
                chunk_size=max(o.part_bytes, -(-size // 9_000)),
                max_concurrency=o.concurrency,
            ),
        )
