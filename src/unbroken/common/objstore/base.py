"""What every object store offers, and the verified transfers built once on top of it.

A backend (:mod:`._obstore`, :mod:`._fsspec`) supplies the primitives: one ranged GET
(``_range``), ``head``, ``list``, ``delete``, ``put_bytes`` and a streamed PUT
(``_put_stream``). :class:`ObjectStore` builds on them, for every backend alike:

* :meth:`ObjectStore.get_file`: a verified download. Every GET is ranged, the last one to one
  byte past the recorded size, so an object that grew is caught at the cost of that byte. An
  object is one GET, or, above ``2 * split_bytes``, a few ranges of about equal length (at
  most ``streams``, each at least ``split_bytes``) fetched at once; each response is streamed
  in buffers of about ``part_bytes`` (memory stays bounded whatever the object's size),
  each buffer written where it belongs in a temporary sibling of the destination (``pwrite``
  from the response buffer: no copy in Python). The first range is hashed (xxh3-128) as it
  arrives; each later one, in order once it is complete, from the file it was written to
  (the page cache): every byte is checked before the file is published, and only a file
  whose size and checksum match is renamed into place. A process killed mid-download
  leaves only a ``.tmp-`` name (:func:`~unbroken.common.fs.is_temp_name`), never a file at
  the destination.
* :meth:`ObjectStore.put_file`: an upload hashed while it is read; a local file that does not
  match its recorded size and checksum is refused before its last part is sent, so the
  store never completes a PUT of damaged bytes (a multipart upload is aborted).
* :meth:`ObjectStore.get_bytes`: a small object whose size is not recorded (a manifest),
  read in one GET bounded by ``max_bytes``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from unbroken.common.errors import ObjectMismatch
from unbroken.common.fs import hasher, open_private, pwrite_all, temp_sibling
from unbroken.common.objstore.options import StoreOptions

__all__ = ["FileSpec", "ObjectStore", "PastEnd", "run_parallel", "share"]

FileSpec = tuple[str, Any, int, str]
"""``(key, local path or descriptor, size in bytes, xxh3-128 hex)``: one file of a transfer."""


class PastEnd(Exception):
    """Internal: a ranged GET started at or after the end of the object (HTTP 416)."""


class _Cancelled(Exception):
    """Internal: another range of the same download failed; this one stops at its next
    buffer."""


def _noop(n: int) -> None:
    pass


def parts(size: int, part: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``size`` bytes, the last ending at ``size + 1``."""
    out = [(a, min(a + part, size)) for a in range(0, size, part)]
    a, _ = out[-1]
    out[-1] = (a, size + 1)
    return out


class ObjectStore:
    """Objects under one root URL (``s3://bucket/prefix``, ``https://host/dir``, any fsspec
    URL); keys are ``/``-joined paths below it. Thread-safe; picklable (a child process opens
    its own connections)."""

    kind = "abstract"

    def __init__(self, url: str, options: StoreOptions) -> None:
        self.url = url.rstrip("/")
        self.options = options
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self._pool_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(_pool=None, _pool_pid=-1, _pool_lock=None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._pool_lock = threading.Lock()

    def url_of(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    # --- what a backend provides ------------------------------------------------------------

    def _range(self, key: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of ``key`` as a buffer (fewer when the object ends first);
        :class:`PastEnd` when ``start`` is at or past its end; ``FileNotFoundError``;
        :class:`~unbroken.common.errors.RemoteStorageError` after the retries."""
        raise NotImplementedError

    def _stream(self, key: str, start: int, end: int) -> Iterator[Any]:
        """Bytes ``[start, end)`` of ``key`` in order, as buffers of about ``part_bytes``
        (fewer bytes in all when the object ends first); :class:`PastEnd` when ``start`` is at
        or past its end; errors as :meth:`_range`. This default asks one :meth:`_range` per
        ``part_bytes``, one after another; a backend that can stream one response overrides
        it."""
        part = self.options.part_bytes
        a = start
        while a < end:
            b = min(a + part, end)
            if end - b <= 1:  # the one byte past the size rides with the last part
                b = end
            try:
                buf = self._range(key, a, b)
            except PastEnd:
                if a == start:
                    raise
                return
            yield buf
            n = len(memoryview(buf))
            if n < b - a:
                return
            a += n

    def head(self, key: str) -> int | None:
        """The size of ``key`` in bytes, or None when there is no such object."""
        raise NotImplementedError

    def list_objects(self, prefix: str = "") -> dict[str, int]:
        """Every object below ``prefix`` (a key prefix ending at a ``/`` boundary, ``""``:
        all), recursively: ``{key: size}`` with keys relative to the root. A bucket (or
        container) that does not exist is a ``FileNotFoundError`` that says so: a typo'd URL
        is not an empty store."""
        raise NotImplementedError

    def list_dirs(self, prefix: str = "") -> list[str]:
        """The names of the "directories" one level below ``prefix`` (key prefixes up to the
        next ``/``, as a listing with a delimiter gives them; objects there are left out),
        sorted: one listing of that level, not of every object under it. A missing bucket is
        a ``FileNotFoundError``, as for :meth:`list_objects`."""
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        """Delete these objects; one already gone is not an error."""
        raise NotImplementedError

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object below ``prefix`` (one already gone is not an error)."""
        self.delete(sorted(self.list_objects(prefix)))

    @property
    def local_root(self) -> str | None:
        """The directory this store's root is, when it is on a local (or mounted)
        filesystem; None for an object store."""
        return None

    def put_bytes(self, key: str, data: bytes) -> None:
        """Publish ``data`` at ``key`` atomically: readers see the old object or all of it."""
        raise NotImplementedError

    def _put_stream(self, key: str, chunks: Iterator[bytes], size: int) -> None:
        """Upload the ``size`` bytes ``chunks`` yields (multipart, ``concurrency`` parts in
        flight); an exception from ``chunks`` aborts the upload: no object is created."""
        raise NotImplementedError

    # --- verified download --------------------------------------------------------------------

    def get_file(
        self,
        key: str,
        dst: str,
        *,
        size: int,
        checksum: str,
        on_bytes: Callable[[int], None] | None = None,
        private: bool = False,
        fsync: bool = False,
        streams: int | None = None,
    ) -> None:
        """Download ``key`` to the local path ``dst``, verified against ``size`` and the
        xxh3-128 ``checksum`` recorded for it (see the module docstring); ``dst`` is either
        untouched or the verified file.

        ``on_bytes(n)`` is called in order as verified bytes arrive (an exception from it
        stops the download and propagates); ``private``: the file is created 0600 without
        following a symlink; ``fsync``: the file is fsynced before the rename; ``streams``:
        the most ranged GETs this file is split into (default ``concurrency``; a caller
        moving several files at once gives each a share). Raises
        :class:`~unbroken.common.errors.ObjectMismatch` (wrong size or checksum),
        ``FileNotFoundError`` (no such object), or
        :class:`~unbroken.common.errors.RemoteStorageError` (the store failed after its
        retries), each naming the URL.
        """
        tmp = temp_sibling(dst)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL  # RDWR: a local copy hashes it back
        if private:
            fd = open_private(tmp, flags)
        else:
            fd = os.open(tmp, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            try:
                want = self.options.concurrency if streams is None else max(1, streams)
                digest = self._get_into(key, fd, size, on_bytes or _noop, want)
                if digest != checksum:
                    raise ObjectMismatch(
                        self.url_of(key),
                        f"xxh3-128 {digest} does not match the recorded {checksum} ({size} bytes)",
                    )
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, dst)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def get_files(
        self,
        files: Sequence[FileSpec],
        *,
        threads: int = 8,
        on_bytes: Callable[[int], None] | None = None,
        private: bool = False,
        fsync: bool = False,
    ) -> None:
        """:meth:`get_file` for each ``(key, dst, size, checksum)``, ``threads`` files at a
        time (a large one also split into ranges: about ``max(threads, concurrency)`` GETs in
        flight in all); the first failure cancels the files not yet started and is raised
        once the started ones have ended. ``on_bytes`` may be called from several threads at
        once."""
        streams = share(self.options.concurrency, threads, len(files))
        jobs = [
            functools.partial(
                self.get_file,
                key,
                dst,
                size=size,
                checksum=checksum,
                on_bytes=on_bytes,
                private=private,
                fsync=fsync,
                streams=streams,
            )
            for key, dst, size, checksum in files
        ]
        run_parallel(jobs, threads, "unbroken-get")

    def put_files(self, files: Sequence[FileSpec], *, threads: int = 8) -> None:
        """:meth:`put_file` for each ``(key, src, size, checksum)`` (``src`` a path or an
        open descriptor), ``threads`` files at a time; failures as in :meth:`get_files`."""
        jobs = [
            functools.partial(self.put_file, key, src, size=size, checksum=checksum)
            for key, src, size, checksum in files
        ]
        run_parallel(jobs, threads, "unbroken-put")

    def _get_into(
        self, key: str, fd: int, size: int, tick: Callable[[int], None], streams: int
    ) -> str:
        """Fetch ``key`` into the open file ``fd`` as at most ``streams`` ranges (module
        docstring); returns the xxh3-128 of its bytes, every one of them hashed."""
        h = hasher()
        if size == 0:  # one byte asked for, as always: an empty object has none (416)
            try:
                n = len(memoryview(self._range(key, 0, 1)))
            except PastEnd:
                n = 0
            if n:
                raise ObjectMismatch(
                    self.url_of(key), "longer than the 0 bytes recorded (got 1 byte at offset 0)"
                )
            return str(h.hexdigest())

        def hashed(buf: Any) -> None:
            h.update(buf)
            tick(len(memoryview(buf)))

        stop = threading.Event()
        n = min(streams, max(1, size // self.options.split_bytes))
        plan = parts(size, -(-size // n))
        if len(plan) == 1:  # one request in the caller's thread: no hand-off to pay for
            self._fetch(key, fd, 0, size + 1, size, hashed, stop)
            return str(h.hexdigest())
        pool = self._executor()
        futs = [pool.submit(self._fetch, key, fd, a, b, size, None, stop) for a, b in plan[1:]]
        try:
            try:
                self._fetch(key, fd, *plan[0], size, hashed, stop)
                for (a, b), f in zip(plan[1:], futs, strict=True):
                    f.result()
                    _hash_back(fd, a, min(b, size), self.options.part_bytes, hashed)
            except _Cancelled:
                wait(futs)  # another range failed: raise its error, not a cancellation
                errs = [f.exception() for f in futs]
                real = [e for e in errs if e is not None and not isinstance(e, _Cancelled)]
                if not real:
                    raise
            else:
                return str(h.hexdigest())
            raise real[0]  # with its own cause (obstore's reason), outside the handler
        finally:
            stop.set()
            for f in futs:
                f.cancel()
            wait(futs)  # no range may write to fd after the caller closes it

    def _fetch(
        self,
        key: str,
        fd: int,
        start: int,
        end: int,
        size: int,
        sink: Callable[[Any], None] | None,
        stop: threading.Event,
    ) -> None:
        """GET ``[start, end)`` streamed: each buffer is checked against ``size``, written at
        its offset and handed to ``sink``; ``stop`` set (by a failure elsewhere) ends it at
        the next buffer. A failure here sets ``stop`` for the other ranges."""
        url = self.url_of(key)
        limit = min(end, size)
        off = start
        try:
            if stop.is_set():
                raise _Cancelled
            try:
                for buf in self._stream(key, start, end):
                    if stop.is_set():
                        raise _Cancelled
                    n = len(memoryview(buf))
                    if off + n > limit:
                        raise ObjectMismatch(
                            url,
                            f"longer than the {size} bytes recorded (got {off + n - start} "
                            f"bytes at offset {start})",
                        )
                    pwrite_all(fd, buf, off)
                    off += n
                    if sink is not None:
                        sink(buf)
            except PastEnd:
                raise ObjectMismatch(
                    url, f"shorter than the {size} bytes recorded (ends before {start})"
                ) from None
            if off != limit:
                raise ObjectMismatch(
                    url,
                    f"shorter than the {size} bytes recorded (got {off - start} bytes at "
                    f"offset {start})",
                )
        except BaseException:
            stop.set()
            raise

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool_pid != os.getpid() and self._pool is not None:
            # a forked child: the parent's lock may have been held by a thread that is gone
            self._pool, self._pool_lock = None, threading.Lock()
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(
                    self.options.concurrency, thread_name_prefix="unbroken-objstore"
                )
                self._pool_pid = os.getpid()
            return self._pool

    def close(self) -> None:
        """Stop this process's part threads (idempotent; the store stays usable)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.shutdown(wait=True)

    def get_bytes(self, key: str, *, max_bytes: int) -> bytes:
        """The whole object ``key`` (a manifest: its size is not recorded anywhere), in one
        GET of at most ``max_bytes + 1`` bytes; a larger object is refused
        (:class:`~unbroken.common.errors.ObjectMismatch`), not read."""
        try:
            buf = self._range(key, 0, max_bytes + 1)
        except PastEnd:
            return b""  # an empty object: a range of it is refused
        if len(memoryview(buf)) > max_bytes:
            raise ObjectMismatch(
                self.url_of(key), f"larger than the {max_bytes:,} bytes allowed for it"
            )
        return bytes(buf)

    # --- verified upload ----------------------------------------------------------------------

    def put_file(
        self, key: str, src: int | str, *, size: int, checksum: str, name: str | None = None
    ) -> None:
        """Upload the local file ``src`` (a path, or an open descriptor read with ``pread``,
        which may be unlinked meanwhile) to ``key``; its bytes are hashed as they are read
        and must be ``size`` bytes with the xxh3-128 ``checksum``. A mismatch raises
        :class:`~unbroken.common.errors.ObjectMismatch` naming ``name`` (default: the path
        or key) before the upload completes: the store keeps no object for it. Up to
        ``part_bytes`` one PUT, above that a multipart upload."""
        if isinstance(src, str):
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                return self.put_file(key, fd, size=size, checksum=checksum, name=name or src)
            finally:
                os.close(fd)
        local = f"local file {name or key}"
        chunks = _verified_chunks(src, size, checksum, self.options.part_bytes, local)
        if size <= self.options.part_bytes:
            self.put_bytes(key, b"".join(chunks))
        else:
            self._put_stream(key, chunks, size)
        return None


_MISSING_CONTAINER = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist")
"""What S3 (and its clones), Azure and GCS answer for a bucket or container that is not there."""


def missing_container(url: str, reason: str) -> FileNotFoundError | None:
    """The error for a listing of ``url`` refused because its bucket does not exist; None
    when ``reason`` says something else."""
    if not any(m in reason for m in _MISSING_CONTAINER):
        return None
    return no_bucket(url)


def no_bucket(url: str) -> FileNotFoundError:
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    return FileNotFoundError(
        f"{url}: the bucket {bucket!r} does not exist (or these credentials cannot see it); "
        "check the URL and the endpoint"
    )


def share(concurrency: int, threads: int, files: int) -> int:
    """Ranged GETs per file when ``threads`` of ``files`` download at once: about
    ``max(concurrency, threads)`` streams in flight in all, at least one per file."""
    return max(1, concurrency // max(1, min(threads, files)))


def _hash_back(fd: int, start: int, end: int, chunk: int, sink: Callable[[Any], None]) -> None:
    """Hand ``sink`` the bytes ``[start, end)`` of ``fd``, read back in ``chunk`` pieces
    (just written: from the page cache)."""
    off = start
    while off < end:
        b = os.pread(fd, min(chunk, end - off), off)
        if not b:
            raise OSError(f"the download's temporary file shrank below {off} bytes")
        sink(b)
        off += len(b)


def run_parallel(jobs: Sequence[Callable[[], Any]], threads: int, name: str) -> None:
    """Run ``jobs`` on ``threads`` threads; on the first failure cancel what has not started
    and raise it (a doomed transfer should not wait for every other file's retries)."""
    if len(jobs) <= 1 or threads <= 1:
        for j in jobs:
            j()
        return
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix=name) as pool:
        futs = [pool.submit(j) for j in jobs]
        try:
            for f in futs:
                f.result()
        except BaseException:
            for f in futs:
                f.cancel()
            raise


def _verified_chunks(fd: int, size: int, checksum: str, part: int, local: str) -> Iterator[bytes]:
    """``size`` bytes of ``fd`` in ``part``-sized chunks, hashed as read; the last chunk is
    yielded only once the whole file matched ``checksum`` (and did not grow)."""
    h = hasher()
    off = 0
    while off < size:
        b = os.pread(fd, min(part, size - off), off)
        if not b:
            raise ObjectMismatch(local, f"shrank to {off} bytes, recorded {size}")
        h.update(b)
        off += len(b)
        if off == size:
            if os.pread(fd, 1, size):
                raise ObjectMismatch(local, f"is longer than the {size} bytes recorded")
            if h.hexdigest() != checksum:
                raise ObjectMismatch(
                    local, f"xxh3-128 {h.hexdigest()} does not match the recorded {checksum}"
                )
        yield b
    if size == 0 and (os.pread(fd, 1, 0) or h.hexdigest() != checksum):
        raise ObjectMismatch(local, f"does not match the recorded 0 bytes / {checksum}")
