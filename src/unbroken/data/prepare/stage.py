"""`unbroken data stage URL LOCAL_DIR`: copy a dataset to local disk before training, verified.

Reads ``dataset.json`` at any URL (``s3://``, ``gs://``, ``file://``, a mounted path, any
fsspec URL), then copies every shard and index file in parallel threads through the
object-store layer (:mod:`unbroken.common.objstore`: obstore for s3/gs/az/http(s), fsspec
otherwise). Each file is written to a temporary sibling, its xxh3-128 checksum (computed as
the ranged GETs arrive from a remote store; read back from the page cache after an in-kernel
copy for a local source) is compared with the manifest, and only then is it renamed into
place; a mismatch is re-fetched, then reported. Files
already present and valid are skipped, so staging again is cheap and an interrupted staging
resumes. ``dataset.json`` is written after all files and the completion marker
``.unbroken-staged`` (holding the dataset fingerprint) last.

Data files are not fsync'ed by default: a staged copy is a cache of the source; after a power
loss the next ``stage`` re-verifies every checksum and re-fetches what is damaged.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.common.errors import ObjectMismatch, RemoteStorageError
from unbroken.common.fs import atomic_write_bytes, checksum_file, is_temp_name, path_str
from unbroken.common.objstore import ObjectStore, StoreOptions, open_store
from unbroken.common.objstore.base import run_parallel
from unbroken.common.progress import progress_bar
from unbroken.data.manifest import DatasetManifest, join_path

__all__ = ["MARKER_NAME", "RemoteStorageError", "StageResult", "fetch_verified", "stage"]

log = logging.getLogger(__name__)

MARKER_NAME = ".unbroken-staged"


@dataclass(frozen=True)
class StageResult:
    """Summary of one staging phase, for the job's own phase accounting."""

    url: str
    local_dir: str
    seconds: float
    bytes_total: int
    bytes_copied: int
    files_copied: int
    files_skipped: int
    files_refetched: int
    waited: bool = False
    """True when this process (LOCAL_RANK != 0 with ranks_local) only waited for rank 0."""

    @property
    def gb_per_s(self) -> float:
        """Throughput of the bytes actually copied (GB = 1e9 bytes)."""
        return self.bytes_copied / 1e9 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        if self.waited:
            return f"staged by local rank 0 into {self.local_dir} (waited {self.seconds:.2f}s)"
        return (
            f"staged {self.url} -> {self.local_dir}: {self.files_copied} files copied "
            f"({self.bytes_copied / 1e9:.3f} GB, {self.files_refetched} re-fetched), "
            f"{self.files_skipped} already valid, in {self.seconds:.2f}s "
            f"({self.gb_per_s:.2f} GB/s)"
        )


@dataclass(frozen=True)
class _File:
    name: str
    size: int
    checksum: str


class _ChecksumMismatch(Exception):
    pass


def _valid_local(path: str, f: _File) -> bool:
    try:
        # a regular file only: hashing a FIFO found there would block until a writer came
        if not os.path.isfile(path) or os.path.getsize(path) != f.size:
            return False
        return checksum_file(path)[1] == f.checksum
    except OSError:
        return False


def _copy_one(
    store: ObjectStore,
    key: str,
    dst: str,
    f: _File,
    fsync: bool,
    on_bytes: Callable[[int], None],
    private: bool = False,
) -> None:
    """One verified attempt: the object-store layer's ``get_file`` (ranged GETs to one byte
    past the size, xxh3-128 while writing, rename only on a match; a local source copied in
    the kernel and hashed from the page cache). Bytes other than recorded raise
    :class:`_ChecksumMismatch`."""
    try:
        store.get_file(
            key,
            dst,
            size=f.size,
            checksum=f.checksum,
            on_bytes=on_bytes,
            private=private,
            fsync=fsync,
        )
    except ObjectMismatch as e:
        raise _ChecksumMismatch(e.reason) from None


def _disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def fetch_verified(
    store: ObjectStore,
    key: str,
    dst: str,
    size: int,
    checksum: str,
    *,
    url: str | None = None,
    retries: int = 1,
    backoff_s: float = 0.0,
    fsync: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    what: str = "staging",
    private: bool = False,
) -> int:
    """Copy the object ``key`` of ``store`` to the local path ``dst``, verified; returns the
    re-fetches.

    The one implementation of "copy a shard and verify it" (``stage`` and the remote-dataset
    cache both use it): the bytes go to a temporary sibling of ``dst``, their size and
    xxh3-128 checksum are compared with ``size``/``checksum`` (from ``dataset.json``) and only
    a match is renamed into place, so ``dst`` is either absent or verified. A failed attempt
    (checksum mismatch, missing object, any transfer error) is retried ``retries`` times,
    ``backoff_s * 2**attempt`` seconds apart (on top of the retries of each request inside
    the object-store layer, ``StoreOptions.retries``); a full local disk is not retried. After
    the last attempt: ``RuntimeError`` (checksum mismatch), ``FileNotFoundError`` (missing) or
    :class:`RemoteStorageError` (the store failed), each naming ``url`` (default: the store's
    URL of ``key``).
    ``on_bytes(n)`` is called as bytes arrive (``n == 0`` when an attempt starts).
    No request asks for more than ``size + 1`` bytes and no more than ``size`` are written.
    ``private``: the file is created 0600 (a node cache's files).
    """
    url = url or store.url_of(key)
    tick = on_bytes or (lambda n: None)
    f = _File(os.path.basename(dst), size, checksum)
    for attempt in range(retries + 1):
        tick(0)
        try:
            _copy_one(store, key, dst, f, fsync, tick, private)
            return attempt
        except Exception as e:
            if _disk_full(e):
                raise RuntimeError(
                    f"{dst}: disk full while {what} ({os.strerror(errno.ENOSPC)}); free space on "
                    f"{os.path.dirname(os.path.abspath(dst))} or use another directory, then re-run"
                ) from e
            if attempt == retries:
                n = f"{retries + 1} {'fetches' if retries else 'fetch'}"
                if isinstance(e, _ChecksumMismatch):
                    raise RuntimeError(
                        f"{url}: checksum mismatch after {n} ({e}); the source copy is damaged - "
                        "re-pack or re-upload it, or re-create the manifest"
                    ) from None
                if isinstance(e, FileNotFoundError):
                    raise FileNotFoundError(
                        f"{url}: not found after {n}; dataset.json lists it - re-upload it or "
                        "re-create the manifest"
                    ) from None
                raise RemoteStorageError(
                    f"{url}: {what} failed after {n} ({type(e).__name__}: {e}); the storage is "
                    "unreachable or failing - check it (endpoint, credentials, network), then "
                    "re-run",
                    url=url,
                ) from e
            delay = backoff_s * 2**attempt
            log.warning(
                "%s: %s (%s: %s); re-fetch %d/%d in %.2fs",
                url,
                "checksum mismatch" if isinstance(e, _ChecksumMismatch) else "fetch failed",
                type(e).__name__,
                e,
                attempt + 1,
                retries,
                delay,
            )
            if delay > 0:
                time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def _wait_for_rank0(local_dir: str, fingerprint: str, timeout: float, url: str) -> float:
    marker = os.path.join(local_dir, MARKER_NAME)
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(OSError):
            # a fixed name: never followed through a symlink (issue 20 item 4)
            fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if os.read(fd, 64).decode("ascii", "replace").strip() == fingerprint:
                    return time.monotonic() - t0
            finally:
                os.close(fd)
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(
                f"{marker}: local rank 0 did not finish staging {url} within {timeout:.0f}s; "
                "check rank 0's log (or raise --wait-timeout)"
            )
        time.sleep(0.1)


def _names(m: DatasetManifest) -> set[str]:
    return {s.name for s in m.shards} | {s.index for s in m.shards}


def _listed(local_dir: str) -> set[str]:
    """The plain file names the dataset already staged in ``local_dir`` lists (none when
    there is no readable manifest: then nothing there is known to be ours)."""
    try:
        names = _names(DatasetManifest.load(local_dir))
    except Exception:  # noqa: BLE001 - damaged or absent: remove nothing
        return set()
    return {n for n in names if n == os.path.basename(n) and n not in ("", ".", "..")}


def _start_over(local_dir: str, marker: str) -> None:
    """The directory is incomplete from here on: drop the completion marker and the
    temporaries of an interrupted staging."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(marker)
    for name in os.listdir(local_dir):
        if is_temp_name(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(local_dir, name))


def _bytes_to_copy(files: list[_File], local_dir: str, url: str) -> int:
    """Bytes of the files not already there at their size; refused up front when the disk
    cannot hold them."""
    need = 0
    for f in files:
        p = os.path.join(local_dir, f.name)
        have = os.path.getsize(p) if os.path.isfile(p) else -1
        if have != f.size:
            need += f.size
    free = shutil.disk_usage(local_dir).free
    if need > free:
        raise RuntimeError(
            f"{local_dir}: staging {url} needs {need:,} bytes but only {free:,} are free; "
            "free space there or stage to another directory"
        )
    return need


class _Copier:
    """Copies the files of one stage into ``local_dir``, verified, from any number of
    threads; counts what it copied, skipped (already there and valid) and re-fetched."""

    def __init__(
        self,
        store: ObjectStore,
        url: str,
        local_dir: str,
        retries: int,
        backoff_s: float,
        fsync: bool,
    ) -> None:
        self.store, self.url, self.local_dir = store, url, local_dir
        self.retries, self.backoff_s, self.fsync = retries, backoff_s, fsync
        self.on_bytes: Callable[[int], object] = lambda n: None
        self.stats = {"copied": 0, "skipped": 0, "refetched": 0, "bytes": 0}
        self._lock = threading.Lock()

    def _bytes(self, n: int) -> None:
        with self._lock:
            self.on_bytes(n)

    def one(self, f: _File) -> None:
        dst = os.path.join(self.local_dir, f.name)
        if _valid_local(dst, f):
            with self._lock:
                self.stats["skipped"] += 1
            return
        refetched = fetch_verified(
            self.store,
            f.name,
            dst,
            f.size,
            f.checksum,
            url=join_path(self.url, f.name),
            retries=self.retries,
            backoff_s=self.backoff_s,
            fsync=self.fsync,
            on_bytes=self._bytes,
        )
        with self._lock:
            self.stats["copied"] += 1
            self.stats["bytes"] += f.size
            self.stats["refetched"] += refetched


def stage(
    url: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    *,
    workers: int = 8,
    fsync: bool = False,
    ranks_local: bool = False,
    wait_timeout: float = 3600.0,
    retries: int = 1,
    backoff_s: float = 0.5,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> StageResult:
    """Copy the dataset at ``url`` into ``local_dir``; returns a :class:`StageResult`.

    ``workers`` parallel transfers (at most the CPU count for a local source); ``retries``
    re-fetches of a file whose checksum does not match, or whose transfer failed, before the
    error is raised (``backoff_s * 2**attempt`` seconds apart; see :func:`fetch_verified`);
    ``ranks_local``: only ``LOCAL_RANK`` 0 copies, the other local ranks wait (up to
    ``wait_timeout`` seconds) for its completion marker.
    """
    url, local_dir = path_str(url), path_str(local_dir)
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    t0 = time.perf_counter()
    store = open_store(url, storage_options, StoreOptions(backoff_s=backoff_s))
    if store.local_root is None:  # the same request path as the files
        manifest = DatasetManifest.from_store(store)
    else:  # a local one is opened as a regular file only (a FIFO planted there never blocks)
        manifest = DatasetManifest.load(url)
    os.makedirs(local_dir, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if ranks_local and local_rank != 0:
        waited = _wait_for_rank0(local_dir, manifest.fingerprint, wait_timeout, url)
        return StageResult(url, local_dir, waited, manifest.total_bytes, 0, 0, 0, 0, True)
    marker = os.path.join(local_dir, MARKER_NAME)
    before = _listed(local_dir)  # an older version staged here: its files go at the end
    _start_over(local_dir, marker)
    files = [_File(s.name, s.bytes, s.checksum) for s in manifest.shards]
    files += [_File(s.index, s.index_bytes, s.index_checksum) for s in manifest.shards]
    need = _bytes_to_copy(files, local_dir, url)
    if getattr(store, "local", False):
        # A local copy is CPU/memory bound (in-kernel copy + checksum): threads beyond
        # the core count only contend (measured: 8 threads cost ~1.5x the CPU of 2).
        workers = min(workers, os.cpu_count() or 1)
    copier = _Copier(store, url, local_dir, retries, backoff_s, fsync)
    bar = progress_bar("stage", total=need, unit="B", enabled=progress)
    try:
        copier.on_bytes = bar.update
        # Largest first so one big shard does not start last and run alone.
        order = sorted(files, key=lambda f: -f.size)
        run_parallel([functools.partial(copier.one, f) for f in order], workers, "unbroken-stage")
    finally:
        bar.close()
    stats = copier.stats
    manifest.save(local_dir)
    atomic_write_bytes(marker, manifest.fingerprint.encode(), fsync=fsync)
    for name in before - _names(manifest):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(os.path.join(local_dir, name))
    res = StageResult(
        url,
        local_dir,
        time.perf_counter() - t0,
        manifest.total_bytes,
        stats["bytes"],
        stats["copied"],
        stats["skipped"],
        stats["refetched"],
    )
    log.info("%s", res)
    return res
