"""Remote datasets: shards streamed from object storage through a bounded, order-aware cache.

``StreamingDataset("s3://bucket/ds", cache_dir="/nvme/cache", cache_limit="200GB")`` (any
fsspec URL) reads ``dataset.json`` remotely and every shard through a local cache shared by
all ranks and DataLoader workers of the node. Three ideas:

* **Order-aware prefetch.** The epoch order is a pure function of (fingerprint, seed, epoch),
  so the *plan* of an epoch - for every shard, the span of epoch positions whose samples it
  holds (a shard is needed for every shuffle window it overlaps) - is known before the epoch
  starts. Each reading process fetches, in parallel threads, the shards of its current
  position plus the next ``prefetch_shards`` in plan order (into the next epoch near the
  end of one). Every download goes through :func:`unbroken.data.prepare.stage.fetch_verified` (the
  checksum from ``dataset.json``, published by an atomic rename), with retries and backoff.
* **A bounded cache evicted by future use.** The cache never holds more than ``cache_limit``
  bytes: shard + index files, downloads in progress included (their bytes are reserved
  before the first byte is written, and no GET asks for more than the size ``dataset.json``
  records + 1), and its own files - the manifest copies, ``.index``, the event log (at most
  ``2 * EVENTS_MAX`` bytes), registrations, network-wait slots and fetcher logs (measured at
  each admission, plus a ``16 KiB`` allowance for what starts before the next one). To make room, shards that the node will not read again
  this epoch go first, then the one read farthest in the future (Belady's rule, exact here
  because the future is known): a shard may only evict shards needed *later* than itself, so
  prefetching never pushes out what a reader needs sooner. The node's future is seen from its
  slowest reader (every reader registers its position).
* **Per-shard locks, robust to a dying process.** ``.locks/<unit>`` is ``flock``-ed
  exclusively while a shard is downloaded or evicted and shared while a reader has it open.
  No shard is downloaded twice at once on a node, an open shard is never evicted (so the
  bytes on disk, open mmaps included, stay within the limit), and the kernel drops the lock
  of a process that dies; its half-written temporaries and reservations are then cleaned up.

* **Nothing unverified is served.** A unit enters the cache verified: downloaded through
  ``fetch_verified``, or found on disk (left by a job whose index was lost, or changed after
  it was verified) and checked against the whole-file checksums of ``dataset.json`` before
  any sample is read from it (a mismatch is discarded and downloaded again). The index keeps,
  per verified unit, a stamp of its files (inode, size, mtime): a file whose stamp changed is
  checked again. The per-member xxh3_64 of a reader cannot stand in for this: it has cheap
  second preimages.

``cache_dir`` is private to the user (created 0700; refused when another user owns it or
group or others can write it, see :func:`unbroken.common.fs.private_dir`); every fixed name in
it is opened without following a symlink, and every file is created 0600.

Layout of ``cache_dir`` (one per node; several datasets may share it and its limit)::

    .lock               flock'ed exclusively around every read-modify-write of .index
    .index              the cached units: header (magic, generation, count, xxh64) + one
                        record per unit of int64 (dataset id, shard, bytes, state 1=ready /
                        2=reserved / 3=found, stamp of its files when ready); rebuilt from
                        the directories when missing or damaged (every unit then "found")
    .events(.1)         one JSON line per download / eviction / discarded or verified file
    .locks/<dir>-<n>    per-unit lock file (empty); its mtime is a download heartbeat
    .readers/<pid>-<k>  each reader's (dataset id, epoch, position, heartbeat ns) as int64
    .stats/<pid>        per DataLoader worker of the rank process <pid>: network wait (ns)
    <dir>/dataset.json  the manifest (dir = the first 16 hex digits of its fingerprint)
    <dir>/<files>       verified shard and index files; ``.tmp-*`` are downloads in flight

A restart reuses the cache: units verified and unchanged since are used at once, partial
files are discarded. Nothing is replayed: prefetch starts at the resumed position.

Every wait has a deadline: a download, or the cache, that makes no progress for
``CacheOptions.timeout`` seconds raises an error naming the URL (a :class:`RemoteStorageError`
when the store stopped answering, which the supervisor classifies as a ``storage`` fault).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import heapq
import itertools
import json
import logging
import mmap
import os
import shutil
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from unbroken.common.config import parse_size
from unbroken.common.fs import (
    checksum_file,
    is_remote,
    is_temp_name,
    open_private,
    private_dir,
    temp_sibling,
)
from unbroken.data.manifest import (
    MAX_MANIFEST_BYTES,
    DatasetManifest,
    join_path,
    read_bounded,
)
from unbroken.data.prepare.stage import RemoteStorageError, fetch_verified
from unbroken.data.stream.order import shards_per_window

__all__ = [
    "EVENTS_MAX",
    "CacheOptions",
    "NetworkWaitProbe",
    "OrderSpec",
    "RemoteCache",
    "RemoteStorageError",
    "check_cache_args",
    "load_remote_manifest",
    "network_probe",
    "open_cache",
    "read_events",
]

log = logging.getLogger(__name__)

_MAGIC = b"UBCACHE2"  # 2: records carry a file stamp; a state "found" (issue 20)
_HEADER = 32  # magic, generation, count, xxh64 of the records
_COLS = 5  # per record: dataset id, shard, bytes, state, stamp of its files (ready only)
_READY, _RESERVED, _FOUND = 1, 2, 3
_NEVER = np.iinfo(np.int64).max  # "no known next use"
_SLOTS = 64  # network-wait slots per rank process (one per DataLoader worker)
_PLANS = 4
EVENTS_MAX = 32 << 10
"""Bytes of ``.events`` before it is rotated to ``.events.1`` (the log holds at most twice
this: its last ~500 events), counted in ``cache_limit``."""
_LOG_MAX = 16 << 10  # a fetcher process's log, counted at this size
_ALLOWANCE = 16 << 10  # what may start between two admissions (a registration, a slot file)


@dataclass(frozen=True)
class CacheOptions:
    """How a remote dataset is fetched (``StreamingDataset(..., cache_options=...)``).

    prefetch_shards: shards fetched ahead of those the current position needs, node-wide, in
        plan order. Default (None): one shuffle window's worth per source, so the next window
        is local when readers reach it, deepened to 3/4 of the room ``cache_limit`` leaves
        beyond two windows (at most four windows' worth); ``unbroken data bench URL``
        suggests a value.
    prefetch_bytes: optional cap on the bytes of those shards.
    threads: parallel downloads per reading process (each rank and each DataLoader worker
        runs its own; a per-shard lock keeps them from fetching the same shard).
    timeout: seconds without progress (no byte downloaded, nothing evicted or published)
        after which a reader gives up with an error naming the shard's URL. Also the
        connect/read timeout given to s3fs when ``storage_options`` does not set one.
    retries: extra attempts per file after a failed transfer or checksum mismatch.
    backoff_s: first delay between attempts; doubles each time.
    fetch_process: download in one helper process per node and dataset (``python -m
        unbroken.data.stream.fetcher``, started by the first reader, gone 10 s after the last):
        a DataLoader worker busy decoding holds the GIL, and downloads running in its own
        threads then crawl (measured 12 MB/s per stream). Readers download themselves
        only what they wait for and the fetcher has not started within ``grace_s``.
    grace_s: seconds a reader waits for the fetcher before downloading a unit itself.
    """

    prefetch_shards: int | None = None
    prefetch_bytes: int | str | None = None
    threads: int = 4
    timeout: float = 60.0
    retries: int = 3
    backoff_s: float = 0.5
    fetch_process: bool = True
    grace_s: float = 2.0

    def __post_init__(self) -> None:
        if self.prefetch_shards is not None and self.prefetch_shards < 0:
            raise ValueError(f"CacheOptions: prefetch_shards={self.prefetch_shards} must be >= 0")
        if self.prefetch_bytes is not None:
            object.__setattr__(self, "prefetch_bytes", parse_size(self.prefetch_bytes))
        if self.threads < 1:
            raise ValueError(f"CacheOptions: threads={self.threads} must be >= 1")
        if not self.timeout > 0:
            raise ValueError(f"CacheOptions: timeout={self.timeout} must be > 0 seconds")
        if self.retries < 0:
            raise ValueError(f"CacheOptions: retries={self.retries} must be >= 0")
        if self.backoff_s < 0:
            raise ValueError(f"CacheOptions: backoff_s={self.backoff_s} must be >= 0")

    @property
    def cap_bytes(self) -> int | None:
        """``prefetch_bytes`` as a number of bytes."""
        return None if self.prefetch_bytes is None else parse_size(self.prefetch_bytes)


def _with_timeouts(url: str, opts: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    """The caller's storage options plus per-call timeouts for s3fs (which defaults to none
    shorter than a minute and retries inside botocore); fresh fsspec instances, because a
    cached async instance does not survive a fork into a DataLoader worker."""
    out = dict(opts or {})
    out.setdefault("skip_instance_cache", True)
    if url.startswith(("s3://", "s3a://")):
        cfg = dict(out.get("config_kwargs") or {})
        cfg.setdefault("connect_timeout", min(timeout, 10.0))
        cfg.setdefault("read_timeout", timeout)
        # Every file is checked against dataset.json's xxh3-128; botocore's own CRC of each
        # response body (on by default since botocore 1.36) would only cost CPU a second time.
        cfg.setdefault("response_checksum_validation", "when_required")
        out["config_kwargs"] = cfg
    return out


def load_remote_manifest(
    url: str, storage_options: dict[str, Any] | None, options: CacheOptions
) -> DatasetManifest:
    """``dataset.json`` at ``url``, retried like a shard; a store that does not answer raises
    :class:`RemoteStorageError` naming the URL."""
    opts = _with_timeouts(url, storage_options, options.timeout)
    for attempt in range(options.retries + 1):
        try:
            return DatasetManifest.load(url, opts)
        except (FileNotFoundError, ValueError):
            raise  # no manifest there / a damaged one: not an outage
        except Exception as e:
            if attempt == options.retries:
                raise RemoteStorageError(
                    f"{join_path(url, 'dataset.json')}: reading the manifest failed after "
                    f"{attempt + 1} attempt(s) ({type(e).__name__}: {e}); the storage is "
                    "unreachable or failing - check endpoint, credentials and network"
                ) from e
            time.sleep(options.backoff_s * 2**attempt)
    raise AssertionError("unreachable")  # pragma: no cover


# --- the plan of an epoch --------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """For one epoch: every (unit, [lo, hi)) span of positions in which the unit is read.

    ``uid/lo/hi`` are sorted by ``lo`` (the prefetch order); ``key``/``key_lo`` index the same
    spans by ``uid * (L + 1) + hi`` for next-use queries.
    """

    epoch: int
    length: int
    uid: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    key: np.ndarray
    key_lo: np.ndarray

    def overlaps(self, uids: np.ndarray, p: int, q: int) -> np.ndarray:
        """Whether each unit is read somewhere in positions ``[p, q]``."""
        s = self.length + 1
        i = np.searchsorted(self.key, uids * s + p, side="right")
        ok = i < self.key.size
        j = np.minimum(i, max(self.key.size - 1, 0))
        return ok & (self.key[j] // s == uids) & (self.key_lo[j] <= q)

    def next_use(self, uids: np.ndarray, p: int) -> np.ndarray:
        """Absolute position (epoch * (L+1) + pos) of each unit's next read at or after
        ``p`` in this epoch; ``_NEVER`` where none."""
        s = self.length + 1
        i = np.searchsorted(self.key, uids * s + p, side="right")
        j = np.minimum(i, max(self.key.size - 1, 0))
        out = np.full(uids.size, _NEVER, dtype=np.int64)
        if self.key.size == 0:
            return out
        ok = (i < self.key.size) & (self.key[j] // s == uids)
        out[ok] = self.epoch * s + np.maximum(self.key_lo[j[ok]], p)
        return out


def _spans(order: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, lo, hi) of one source pass in its own positions: a shard is read in every
    shuffle window its stretch of the permuted shard stream overlaps."""
    counts = np.asarray(order.counts, dtype=np.int64)
    shard = np.asarray(order.shard_order, dtype=np.int64)
    ends = np.cumsum(counts[shard])
    starts = ends - counts[shard]
    keep = counts[shard] > 0
    shard, starts, ends = shard[keep], starts[keep], ends[keep]
    if not order.shuffle:
        return shard, starts, ends
    w = int(order.window)
    return shard, (starts // w) * w, np.minimum(order.length, ((ends - 1) // w + 1) * w)


class OrderSpec:
    """What the epoch order of a ``StreamingDataset`` depends on, without the dataset (no
    torch, no readers, no transform): enough to plan an epoch in the fetcher process.

    ``_pass_order(i, epoch, k)`` is the :class:`~unbroken.data.stream.order.EpochOrder` that
    ``StreamingDataset._pass_order`` returns (a unit test holds the two together).
    """

    def __init__(self, ds: Any) -> None:
        self.fingerprint = str(ds.fingerprint)
        self.seed = int(ds.seed)
        self.shuffle = bool(ds.shuffle)
        self.epoch_length = int(ds.epoch_length)
        self.mix_block = int(ds.mix_block)
        self.weights = tuple(float(w) for w in ds.weights)
        self.sources = tuple(s.root for s in ds.sources)
        self.shuffle_window = tuple(int(w) for w in ds.shuffle_window)
        self._sizes = tuple(int(n) for n in ds._sizes)
        self.counts = [np.asarray(r.counts, dtype=np.int64) for r in ds._readers]
        self.fingerprints = [str(r.fingerprint) for r in ds._readers]
        self._orders: OrderedDict[tuple[int, int, int], Any] = OrderedDict()

    def _pass_order(self, i: int, epoch: int, k: int) -> Any:
        from unbroken.data.stream.order import EpochOrder

        key = (i, epoch, k)
        hit = self._orders.get(key)
        if hit is None:
            hit = EpochOrder(
                self.counts[i],
                self.fingerprints[i],
                self.seed,
                epoch,
                shuffle=self.shuffle,
                shuffle_window=self.shuffle_window[i] or None,
                salt=() if len(self.sources) == 1 else (i, k),
            )
            self._orders[key] = hit
            if len(self._orders) > 16:
                self._orders.popitem(last=False)
        return hit

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_orders": OrderedDict()}


def _blocks_before(ds: Any, i: int, nblocks: int) -> np.ndarray:
    """Slots of source ``i`` in mixture blocks ``0..b-1`` for every ``b <= nblocks``: the
    same cumulative floors as :class:`~unbroken.data.stream.order.MixtureOrder`, exactly, in int64
    (``floor(n*p/q) = (n//q)*p + (n%q)*p//q`` keeps every product below 2**62)."""
    from unbroken.data.stream.order import MixtureOrder

    cum = MixtureOrder(ds.weights, "", 0, 0, 1, block=ds.mix_block).cum
    n = np.arange(nblocks + 1, dtype=np.int64) * int(ds.mix_block)

    def floor_at(k: int) -> np.ndarray:
        if k < 0:
            return np.zeros_like(n)
        p, q = cum[k].numerator, cum[k].denominator
        return (n // q) * p + (n % q) * p // q

    return floor_at(i) - floor_at(i - 1)


def epoch_plan(ds: Any, epoch: int, sources: dict[int, int]) -> _Plan:
    """The plan of ``epoch`` for the sources ``{source index: uid of its shard 0}`` of a
    ``StreamingDataset``: every span of positions in which a shard is read."""
    length = int(ds.epoch_length)
    uids, los, his = [], [], []
    single = len(ds.sources) == 1
    for i, base in sources.items():
        n = int(ds._sizes[i])
        if single:
            sh, lo, hi = _spans(ds._pass_order(i, epoch, 0))
        else:
            # Mixture: source offset o (counted across passes) lies in the block b with
            # before(b) <= o < before(b+1), anywhere among its positions (slots are permuted).
            blk = int(ds.mix_block)
            nb = -(-length // blk)
            before = _blocks_before(ds, i, nb)
            parts = []
            for k in range(-(-int(before[-1]) // n)):
                ps, a, b = _spans(ds._pass_order(i, epoch, k))
                first = np.searchsorted(before, a + k * n, side="right") - 1
                last = np.searchsorted(before, b - 1 + k * n, side="right") - 1
                parts.append(
                    (ps, np.minimum(first * blk, length), np.minimum((last + 1) * blk, length))
                )
            sh = np.concatenate([q[0] for q in parts])
            lo = np.concatenate([q[1] for q in parts])
            hi = np.concatenate([q[2] for q in parts])
            keep = lo < hi
            sh, lo, hi = sh[keep], lo[keep], hi[keep]
        uids.append(sh + base)
        los.append(lo)
        his.append(hi)
    uid = np.concatenate(uids).astype(np.int64)
    lo = np.concatenate(los).astype(np.int64)
    hi = np.concatenate(his).astype(np.int64)
    o = np.lexsort((uid, lo))
    key = uid * (length + 1) + hi
    ko = np.argsort(key, kind="stable")
    return _Plan(epoch, length, uid[o], lo[o], hi[o], key[ko], lo[ko])


# --- the shared index ------------------------------------------------------------------------


def _pack_index(gen: int, rec: np.ndarray) -> bytes:
    body = np.ascontiguousarray(rec, dtype=np.int64).reshape(-1, _COLS).tobytes()
    head = np.array([gen, rec.shape[0], xxhash.xxh64_intdigest(body) >> 1], dtype=np.int64)
    return _MAGIC + head.tobytes() + body


def _unpack_index(data: bytes) -> tuple[int, np.ndarray] | None:
    if len(data) < _HEADER or data[:8] != _MAGIC:
        return None
    gen, n, digest = np.frombuffer(data[8:_HEADER], dtype=np.int64).tolist()
    body = data[_HEADER:]
    if n < 0 or len(body) != n * 8 * _COLS or xxhash.xxh64_intdigest(body) >> 1 != digest:
        return None
    return gen, np.frombuffer(body, dtype=np.int64).reshape(n, _COLS).copy()


def _stamp(files: list[tuple[str, int]]) -> int:
    """What a unit's files are now, as one positive int64: a hash of (device, inode, size,
    mtime) of each; 0 when one is missing, not a regular file or not of its recorded size.
    A file replaced or written since it was verified has another stamp."""
    parts = []
    for path, size in files:
        try:
            st = os.lstat(path)
        except OSError:
            return 0
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return 0
        parts += [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    return (xxhash.xxh64_intdigest(struct.pack(f"<{len(parts)}Q", *parts)) >> 1) or 1


def _read_private(path: str, limit: int | None = None) -> bytes:
    """The bytes of a fixed name in the cache (no symlink followed), up to ``limit``."""
    fd = open_private(path, os.O_RDONLY)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read() if limit is None else read_bounded(f, limit)
    finally:
        os.close(fd)


def _write_private(path: str, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically, mode 0600 (a temporary sibling, renamed)."""
    tmp = temp_sibling(path)
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _load_manifest(local: str) -> DatasetManifest:
    """A manifest copy inside the cache (read without following a symlink)."""
    path = os.path.join(local, "dataset.json")
    return DatasetManifest.parse(_read_private(path, MAX_MANIFEST_BYTES + 1), source=path)


def _dir_name(dir_id: int) -> str:
    return f"{dir_id & (2**64 - 1):016x}"


def _dir_id(fingerprint: str) -> int:
    return int(np.array([int(fingerprint[:16], 16)], dtype=np.uint64).view(np.int64)[0])


# Every lock and registration fd this module opens. A fork (a DataLoader worker) inherits
# them; an inherited flock'ed fd would keep a unit locked for as long as the child lives, so
# the child closes them all right after the fork (the parent's locks stay as they were).
_FDS: set[int] = set()


def _open_fd(path: str) -> int:
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    _FDS.add(fd)
    return fd


def _close_fd(fd: int) -> None:
    _FDS.discard(fd)
    os.close(fd)


def _close_inherited() -> None:
    for fd in list(_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _FDS.clear()


os.register_at_fork(after_in_child=_close_inherited)

_CHILDREN: list[Any] = []  # fetcher processes started here (kept to be reaped, not waited for)


class _Forked:
    """``poll()`` for a multiprocessing child, like ``subprocess.Popen``'s."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    def poll(self) -> int | None:
        return self.proc.exitcode


def _mp_child() -> bool:
    import multiprocessing

    return multiprocessing.parent_process() is not None


def _flock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class _Stopped(BaseException):
    """Raised inside a download when its process shuts down (not retried, not an error)."""


class _Pin:
    """A shared lock on one unit's lock file: the unit cannot be evicted while held."""

    __slots__ = ("fd", "pid")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd < 0 or os.getpid() != self.pid:
            return  # an inherited pin: the fork hook closed the child's copy already
        # LOCK_UN acts on the open file description, for every process sharing it.
        fcntl.flock(fd, fcntl.LOCK_UN)
        _close_fd(fd)


class _PinnedShard:
    """An open shard (``_MappedShard`` / ``TokenShard``) plus its pin, released on close."""

    __slots__ = ("inner", "pin")

    def __init__(self, inner: Any, pin: _Pin) -> None:
        self.inner = inner
        self.pin = pin

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        try:
            close = getattr(self.inner, "close", None)
            if close is not None:
                close()
        finally:
            self.pin.release()


# --- a small priority thread pool ------------------------------------------------------------


class _Pool:
    """Download threads taking the unit needed soonest first (a reader's demand jumps the
    prefetch queue); one task per unit at a time."""

    def __init__(self, threads: int, fn: Callable[[int, int], str], name: str) -> None:
        self._fn = fn
        self._n = threads
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, int]] = []
        # uid -> (future, prio, seq); seq -1 once running
        self._tasks: dict[int, tuple[Future[str], int, int]] = {}
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self.stopping = False

    def submit(self, uid: int, prio: int) -> Future[str]:
        with self._cond:
            task = self._tasks.get(uid)
            if task is not None:
                fut, old, queued = task
                if queued >= 0 and prio < old:  # more urgent: queue again, skip the stale entry
                    seq = next(self._seq)
                    self._tasks[uid] = (fut, prio, seq)
                    heapq.heappush(self._heap, (prio, seq, uid))
                    self._cond.notify()
                return fut
            fut = Future()
            seq = next(self._seq)
            self._tasks[uid] = (fut, prio, seq)
            heapq.heappush(self._heap, (prio, seq, uid))
            if self._idle == 0 and len(self._threads) < self._n:
                t = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
            self._cond.notify()
            return fut

    def busy(self, uid: int) -> bool:
        with self._cond:
            return uid in self._tasks

    def drop_queued(self, keep: int = -1) -> None:
        """Forget the tasks not started yet (except unit ``keep``)."""
        with self._cond:
            for uid, (fut, _, seq) in list(self._tasks.items()):
                if seq >= 0 and uid != keep:
                    del self._tasks[uid]
                    fut.cancel()

    def stop(self, timeout: float) -> None:
        """Drop the queued tasks, make the running downloads abort (``stopping`` is checked as
        bytes arrive: their partial files and reservations are removed) and wait for them."""
        with self._cond:
            self.stopping = True
            self._heap.clear()
            for uid, (fut, _, seq) in list(self._tasks.items()):
                if seq >= 0:
                    del self._tasks[uid]
                    fut.cancel()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while not self._heap:
                        if self.stopping:
                            return
                        self._idle += 1
                        self._cond.wait()
                        self._idle -= 1
                    prio, seq, uid = heapq.heappop(self._heap)
                    task = self._tasks.get(uid)
                    if task is not None and task[2] == seq:
                        self._tasks[uid] = (task[0], prio, -1)
                        break
            fut = task[0]
            fut.set_running_or_notify_cancel()
            try:
                res = self._fn(uid, prio)
            except BaseException as e:  # handed to whoever waits on the unit
                with self._cond:
                    self._tasks.pop(uid, None)
                fut.set_exception(e)
            else:
                with self._cond:
                    self._tasks.pop(uid, None)
                fut.set_result(res)


# --- network wait accounting -----------------------------------------------------------------


def _stats_path(cache_dir: str, pid: int) -> str:
    return os.path.join(cache_dir, ".stats", str(pid))


def _map_stats(path: str) -> tuple[mmap.mmap, np.ndarray]:
    private_dir(os.path.dirname(path), purpose="cache directory")
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        if os.fstat(fd).st_size < _SLOTS * 16:
            os.ftruncate(fd, _SLOTS * 16)
        mm = mmap.mmap(fd, _SLOTS * 16)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.int64).reshape(_SLOTS, 2)


class NetworkWaitProbe:
    """Read side of the network-wait counters of one rank process (default: this one).

    Each reading process of the rank (the process itself with ``num_workers=0``, else each
    DataLoader worker, whose parent is the rank process) keeps in ``.stats/<pid>`` the total
    nanoseconds it spent blocked on a download and when its current block began.
    :class:`unbroken.data.diagnose.timer.StepTimer` reads it around every ``next()``.
    """

    def __init__(self, cache_dir: str, pid: int | None = None) -> None:
        self.path = _stats_path(cache_dir, os.getpid() if pid is None else pid)
        self._mm, self._slots = _map_stats(self.path)

    def blocked_ns(self) -> np.ndarray:
        """Per reading process: nanoseconds blocked on downloads so far (a block in progress
        counted up to now)."""
        s = self._slots.copy()
        now = time.monotonic_ns()
        since = s[:, 1]
        return s[:, 0] + np.where(since > 0, np.maximum(now - since, 0), 0)

    def close(self) -> None:
        self._mm.close()


def network_probe(dataset: Any) -> NetworkWaitProbe | None:
    """The probe for a ``StreamingDataset`` reading a remote source; None for local data."""
    cache = getattr(dataset, "_cache", None)
    return None if cache is None else NetworkWaitProbe(cache.cache_dir)


# --- the cache -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dir:
    """One remote dataset (a manifest) in the cache."""

    id: int
    name: str
    url: str
    manifest: DatasetManifest
    storage_options: dict[str, Any]
    base: int  # uid of its shard 0


class _Proc:
    """What belongs to one process (rebuilt after a fork into a DataLoader worker)."""

    def __init__(self, cache: RemoteCache) -> None:
        self.pid = os.getpid()
        self.lock = threading.RLock()  # threads of this process around the .lock flock
        self.index_fd = _open_fd(os.path.join(cache.cache_dir, ".lock"))
        self.pool = _Pool(cache.options.threads, cache._fetch, "unbroken-cache")
        self.fs: dict[int, tuple[Any, str]] = {}
        self.retry_after: dict[int, float] = {}
        self.reg_fd = -1
        self.fetcher_up = False
        self.fetcher_checked = -1e9
        self.fetcher_spawned = -1e9
        self.pos = (-1, 0)
        self.next_eval = (-1, -1, 0.0)  # (epoch, boundary position, time) of the prefetch plan
        self.slot: np.ndarray | None = None
        self.slot_mm: mmap.mmap | None = None
        self.wakers: dict[int, threading.Event] = {}  # unit -> set when its lock is released
        self.stamps: dict[tuple[int, int], int] = {}  # ready units' stamps at stamps_gen
        self.stamps_gen = -1
        self.gen_fd = -1  # .index, read-only, for its generation
        # On exit, abort the downloads in flight so that they leave no partial file or
        # reservation behind (a DataLoader worker exits through multiprocessing, which runs
        # its finalizers but not atexit).
        import multiprocessing.util as mpu

        stop = self.pool.stop
        if _mp_child():
            mpu.Finalize(self, stop, args=(2.0,), exitpriority=100)
        else:
            atexit.register(stop, 2.0)


class RemoteCache:
    """The node-local cache of one :class:`~unbroken.data.stream.dataset.StreamingDataset`'s remote
    sources (see the module docstring). Built by :func:`open_cache`; per process, it owns a
    download pool, the reader's registration and its network-wait slot.
    """

    def __init__(
        self,
        ds: Any,
        cache_dir: str,
        limit: int | None,
        options: CacheOptions,
        storage_options: dict[str, Any] | None,
    ) -> None:
        self.cache_dir = private_dir(os.path.abspath(cache_dir), purpose="cache directory")
        self.limit = limit
        self.options = options
        self.order = OrderSpec(ds)
        self.ds_id = _dir_id(xxhash.xxh3_64_hexdigest(ds.fingerprint.encode()))
        self.length = int(ds.epoch_length)
        dirs: list[_Dir] = []
        by_fp: dict[str, _Dir] = {}
        self.src_dir: dict[int, _Dir] = {}
        self.readers: list[Any] = []
        base = 0
        for i, (src, reader) in enumerate(zip(ds.sources, ds._readers, strict=True)):
            if not is_remote(src.root):
                continue
            m: DatasetManifest = reader.manifest
            d = by_fp.get(m.fingerprint)
            if d is None:
                opts = src.storage_options if src.storage_options is not None else storage_options
                d = _Dir(
                    _dir_id(m.fingerprint),
                    m.fingerprint[:16],
                    src.root,
                    m,
                    _with_timeouts(src.root, opts, options.timeout),
                    base,
                )
                base += len(m.shards)
                by_fp[m.fingerprint] = d
                dirs.append(d)
            self.src_dir[i] = d
            reader.root = os.path.join(self.cache_dir, d.name)
            reader.cache = self
            self.readers.append(reader)
        self.dirs = dirs
        self._by_id = {d.id: d for d in dirs}
        self._by_fp = by_fp
        n = base
        self.unit_bytes = np.zeros(n, dtype=np.int64)
        self.unit_dir = np.zeros(n, dtype=np.int64)
        for d in dirs:
            sl = slice(d.base, d.base + len(d.manifest.shards))
            self.unit_bytes[sl] = [s.bytes + s.index_bytes for s in d.manifest.shards]
            self.unit_dir[sl] = d.id
        for sub in (".locks", ".readers", ".stats", ".fetch"):
            private_dir(os.path.join(self.cache_dir, sub), purpose="cache directory")
        wrote = False
        for d in dirs:
            local = private_dir(os.path.join(self.cache_dir, d.name), purpose="cache directory")
            if not os.path.lexists(os.path.join(local, "dataset.json")):
                _write_private(os.path.join(local, "dataset.json"), d.manifest.dumps().encode())
                wrote = True
        self._foreign: dict[int, DatasetManifest | None] = {}
        self._plans: OrderedDict[int, _Plan] = OrderedDict()
        self._plan_lock = threading.Lock()
        self._state: _Proc | None = None
        self.prefetch_shards = (
            options.prefetch_shards
            if options.prefetch_shards is not None
            else sum(self._window_units(i) for i in self.src_dir)
        )
        self._check_limit()
        if options.prefetch_shards is None:
            self.prefetch_shards = self._default_depth()
        self._sweep_stats()
        if wrote:
            self._make_room()

    # --- per process --------------------------------------------------------------------

    def _proc(self) -> _Proc:
        st = self._state
        if st is None or st.pid != os.getpid():
            if st is not None:
                # Forked: the parent's threads are gone and its fds were closed by the fork
                # hook. Close the shards the parent had open: their maps would keep evicted
                # bytes on disk.
                for r in self.readers:
                    for sh in list(r._open.values()):
                        with contextlib.suppress(Exception):
                            sh.close()
                    r._open.clear()
                self._plan_lock = threading.Lock()
            st = self._state = _Proc(self)
        return st

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_state"] = None
        d["_plan_lock"] = None
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._plan_lock = threading.Lock()

    def _fs(self, d: _Dir) -> tuple[Any, str]:
        st = self._proc()
        hit = st.fs.get(d.id)
        if hit is None:
            import fsspec

            hit = fsspec.core.url_to_fs(d.url, **d.storage_options)
            st.fs[d.id] = hit
        return hit

    # --- units ----------------------------------------------------------------------------

    def _unit(self, uid: int) -> tuple[_Dir, int]:
        d = self._by_id[int(self.unit_dir[uid])]
        return d, uid - d.base

    def _files(self, dir_id: int, shard: int) -> list[tuple[str, int]] | None:
        """(path, size) of a unit's data and index file; None for an unknown foreign unit."""
        d = self._by_id.get(dir_id)
        if d is not None:
            m: DatasetManifest | None = d.manifest
        else:
            if dir_id not in self._foreign:
                try:
                    m = _load_manifest(os.path.join(self.cache_dir, _dir_name(dir_id)))
                except (OSError, ValueError):
                    m = None
                self._foreign[dir_id] = m
            m = self._foreign[dir_id]
        if m is None or not 0 <= shard < len(m.shards):
            return None
        s = m.shards[shard]
        local = os.path.join(self.cache_dir, _dir_name(dir_id))
        return [
            (os.path.join(local, s.name), s.bytes),
            (os.path.join(local, s.index), s.index_bytes),
        ]

    def _lock_path(self, dir_id: int, shard: int) -> str:
        return os.path.join(self.cache_dir, ".locks", f"{_dir_name(dir_id)}-{shard}")

    @staticmethod
    def _complete(files: list[tuple[str, int]]) -> bool:
        """Every file there, a regular file of its recorded size (not yet verified)."""
        return bool(files) and _stamp(files) != 0

    def _present(self, uid: int) -> bool:
        """The unit is ready to read: verified when it entered the cache, and its files are
        the ones verified (their stamp unchanged)."""
        d, shard = self._unit(uid)
        files = self._files(d.id, shard)
        if files is None:
            return False
        want = self._ready_stamps().get((d.id, shard))
        return want is not None and want == _stamp(files)

    def _ready_stamps(self) -> dict[tuple[int, int], int]:
        """{(dataset id, shard): stamp} of the ready units, re-read when the index changed
        (its generation, 16 bytes, is read each time; the records only after a change)."""
        st = self._proc()
        gen = self._generation()
        if gen == 0 or gen != st.stamps_gen:
            try:
                snap = _unpack_index(_read_private(os.path.join(self.cache_dir, ".index")))
            except FileNotFoundError:
                snap = None
            if snap is None:  # missing, or caught mid-write: read it under the lock
                with self._locked() as got:
                    snap = got
            g, rec = snap
            ready = rec[rec[:, 3] == _READY]
            st.stamps = {(a, b): c for a, b, c in ready[:, [0, 1, 4]].tolist()}
            st.stamps_gen = g
        return st.stamps

    def _open_lock(self, dir_id: int, shard: int) -> int:
        return _open_fd(self._lock_path(dir_id, shard))

    # --- the limit ------------------------------------------------------------------------

    def _window_units(self, i: int) -> int:
        w = int(self.order.shuffle_window[i])
        return shards_per_window(self.order.counts[i], w) if w else 2

    def min_limit(self) -> tuple[int, str]:
        """Bytes the cache must hold at least, and how that figure is made up."""
        held = 0
        parts = []
        largest = []
        for i, d in self.src_dir.items():
            sizes = np.sort(self.unit_bytes[d.base : d.base + len(d.manifest.shards)])[::-1]
            w = int(self.order.shuffle_window[i])
            if len(self.order.sources) > 1:
                # a mixture block's slots are permuted: one block holds ~block*weight samples
                # of this source, which its readers need at once
                w += int(np.ceil(self.order.mix_block * self.order.weights[i]))
            k = shards_per_window(self.order.counts[i], 2 * w) if w else 2
            held += int(sizes[:k].sum())
            parts.append(f"{k} shards of up to {int(sizes[0]):,} bytes")
            largest.append(sizes)
        every = np.sort(np.concatenate(largest))[::-1]
        ahead = int(every[: self.prefetch_shards].sum())
        if self.options.cap_bytes is not None:
            ahead = min(ahead, self.options.cap_bytes + int(every[0]))
        units = sum(len(p) for p in parts) + self.prefetch_shards  # an upper bound of records
        own = (
            _HEADER
            + 8 * _COLS * (units + 8)
            + 2 * EVENTS_MAX
            + _LOG_MAX
            + _ALLOWANCE
            + sum(len(d.manifest.dumps()) for d in self.dirs)
        )
        why = (
            f"two consecutive shuffle windows (and mixture blocks) need {held:,} bytes "
            f"({'; '.join(parts)}), "
            f"prefetching {self.prefetch_shards} shards ahead {ahead:,} and the cache's own "
            f"files (manifest, index, event log) about {own:,}"
        )
        return held + ahead + own, why

    def _default_depth(self) -> int:
        """Prefetch depth when ``prefetch_shards`` is not given: one shuffle window's worth,
        deepened to three quarters of the room the limit leaves beyond two windows (at most
        four windows' worth). The quarter left free is what a reader's next shard is admitted
        into without evicting a prefetched one. Measured on the issue-14 bench (cache = 25%
        of the dataset): 9 -> 14 shards ahead, epoch 1 24k -> 28k samples/s, same bytes;
        the whole room (19) downloaded 3-7% more and was no faster."""
        window = self.prefetch_shards
        if self.limit is None:
            return window
        need, _ = self.min_limit()
        biggest = int(self.unit_bytes.max()) if self.unit_bytes.size else 1
        room = (self.limit - need) // max(biggest, 1) + window  # shards beyond two windows
        return int(min(max(window, room * 3 // 4), 4 * window))

    def _check_limit(self) -> None:
        need, why = self.min_limit()
        if self.limit is not None and self.limit < need:
            raise ValueError(
                f"cache_limit={self.limit:,} bytes is too small: {why}; pass cache_limit >= "
                f"{need:,} (or a smaller shuffle_window, or CacheOptions(prefetch_shards=...))"
            )
        if self.limit is not None:
            with contextlib.suppress(OSError):
                free = shutil.disk_usage(self.cache_dir).free
                if free + self._used() < self.limit:
                    log.warning(
                        "%s: cache_limit=%s bytes but only %s bytes are free there; "
                        "downloads will fail with a full disk first",
                        self.cache_dir,
                        f"{self.limit:,}",
                        f"{free:,}",
                    )

    def _used(self, rec: np.ndarray | None = None, extra: int = 0) -> int:
        """Bytes the cache holds: its units (``rec``, the index records; read under the lock
        when not given) and its own files, the index at ``extra`` more records."""
        if rec is None:
            with self._locked() as (_, rec):
                return self._used(rec, extra)
        return int(rec[:, 2].sum()) + self._bookkeeping(rec.shape[0] + extra)

    def _bookkeeping(self, records: int) -> int:
        """Bytes of the cache's own files (issue 20 item 10): ``.index`` at ``records``
        records; the event log at its bound; each fetcher log at its bound; the manifest
        copies, registrations and network-wait slots as they are now; plus an allowance for
        what may start before the next admission (a reader's registration, a slot file)."""
        top = self.cache_dir
        total = _HEADER + 8 * _COLS * records + _ALLOWANCE
        events = 0
        for name in (".events", ".events.1"):
            with contextlib.suppress(OSError):
                events += os.lstat(os.path.join(top, name)).st_size
        total += max(events, 2 * EVENTS_MAX)
        for sub in (".readers", ".stats", ".fetch"):
            with contextlib.suppress(OSError), os.scandir(os.path.join(top, sub)) as it:
                for e in it:
                    if e.name.endswith(".log"):
                        total += _LOG_MAX
                        continue
                    with contextlib.suppress(OSError):
                        total += e.stat(follow_symlinks=False).st_size
        with contextlib.suppress(OSError), os.scandir(top) as it:
            for e in it:
                if len(e.name) == 16 and not e.name.startswith("."):
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(e.path, "dataset.json")).st_size
        return total

    def _make_room(self) -> None:
        """Evict what is needed last until the cache is within its limit (after this
        dataset's manifest copy was written into a full cache)."""
        if self.limit is None:
            return
        with self._locked() as (gen, rec):
            short = self._used(rec) - self.limit
            victims = self._choose(rec, -1, short) if short > 0 else None
            if victims:
                self._write(gen + 1, self._evict(rec, victims))

    # --- the plan -------------------------------------------------------------------------

    def plan(self, epoch: int) -> _Plan:
        with self._plan_lock:
            hit = self._plans.get(epoch)
            if hit is not None:
                self._plans.move_to_end(epoch)
                return hit
        p = self._build_plan(epoch)
        with self._plan_lock:
            self._plans[epoch] = p
            if len(self._plans) > _PLANS:
                self._plans.popitem(last=False)
        return p

    def _build_plan(self, epoch: int) -> _Plan:
        return epoch_plan(self.order, epoch, {i: d.base for i, d in self.src_dir.items()})

    def _abs(self, epoch: int, pos: int) -> int:
        return epoch * (self.length + 1) + pos

    # --- reading ---------------------------------------------------------------------------

    def advance(self, epoch: int, positions: np.ndarray) -> None:
        """A reader is about to read ``positions`` of ``epoch``: register the position, close
        the shards it is done with, start the downloads it will need next."""
        st = self._proc()
        p = int(positions[0]) if len(positions) else 0
        st.pos = (epoch, p)
        self._register(st, epoch, p)
        plan = self.plan(epoch)
        self._release_done(plan, p, int(positions.max()) if len(positions) else p)
        if self.fetcher_alive():
            st.pool.drop_queued()  # what this process queued before the fetcher came up
            return  # the fetcher process prefetches for every reader of the node
        e, bound, t = st.next_eval
        now = time.monotonic()
        if e == epoch and p < bound and now - t < 0.05:
            return  # same stretch of the plan, checked moments ago
        st.next_eval = (epoch, self._prefetch(st, plan, p), now)

    def park(self) -> None:
        """This process stopped reading (its batch iterator was closed): unpin its shards and
        leave the node's frame. Else a process that made one batch and moved on (the
        loader's first batch, made in the training process while its workers start) would
        hold prefetch and eviction at its position until its registration went stale
        (``timeout``). The next :meth:`advance` registers it again."""
        st = self._state
        if st is None or st.pid != os.getpid():
            return  # never read here (or only in the parent before a fork)
        self._unpin_all()
        if st.reg_fd >= 0:
            with contextlib.suppress(OSError):
                os.pwrite(st.reg_fd, np.array([-1], dtype=np.int64).tobytes(), 8)  # epoch -1

    def _release_done(self, plan: _Plan, p: int, q: int) -> None:
        for r in self.readers:
            if not r._open:
                continue
            d = self._by_fp[r.manifest.fingerprint]
            shards = np.fromiter(r._open.keys(), dtype=np.int64, count=len(r._open))
            done = shards[~plan.overlaps(shards + d.base, p, q)]
            for sh in done.tolist():
                with contextlib.suppress(Exception):
                    r._open.pop(sh).close()

    def _unpin_all(self) -> None:
        """Close every shard this process has open: it is about to wait for room, and its
        pins must not be what keeps the cache full."""
        for r in self.readers:
            while r._open:
                _, sh = r._open.popitem()
                with contextlib.suppress(Exception):
                    sh.close()

    def _prefetch(self, st: _Proc, plan: _Plan, p: int) -> int:
        """Queue the units read at ``p`` and the next ``prefetch_shards``; returns the next
        position at which that set changes."""
        cut = int(np.searchsorted(plan.lo, p, side="right"))
        cur = plan.uid[:cut][plan.hi[:cut] > p]
        bound = int(plan.hi[:cut][plan.hi[:cut] > p].min()) if cur.size else self.length
        if cut < plan.lo.size:
            bound = min(bound, int(plan.lo[cut]))
        targets: list[tuple[int, int]] = [
            (int(u), self._abs(plan.epoch, p)) for u in dict.fromkeys(cur.tolist())
        ]
        seen = {u for u, _ in targets}
        want = self.prefetch_shards
        cap = self.options.cap_bytes
        got = nbytes = 0
        for ahead in (plan, self.plan(plan.epoch + 1)):
            start = cut if ahead is plan else 0
            while got < want and start < ahead.uid.size:
                stop = start + 4 * want + 64  # a slice at a time: plans can be long
                for u, lo in zip(
                    ahead.uid[start:stop].tolist(), ahead.lo[start:stop].tolist(), strict=True
                ):
                    if u in seen:
                        continue
                    b = int(self.unit_bytes[u])
                    if got >= want or (cap is not None and got and nbytes + b > cap):
                        got = want
                        break
                    seen.add(u)
                    targets.append((u, self._abs(ahead.epoch, lo)))
                    got += 1
                    nbytes += b
                start = stop
            if got >= want:
                break
        now = time.monotonic()
        for u, prio in targets:
            if st.retry_after.get(u, 0.0) > now or st.pool.busy(u) or self._present(u):
                continue
            st.pool.submit(u, prio)
        return bound

    def open(self, reader: Any, shard: int) -> _PinnedShard:
        """Open ``reader``'s ``shard`` from the cache (waiting for its download), pinned."""
        d = self._by_fp[reader.manifest.fingerprint]
        pin = self._acquire(d.base + shard)
        try:
            inner = reader._open_shard(shard)
        except BaseException:
            pin.release()
            raise
        return _PinnedShard(inner, pin)

    def _try_pin(self, uid: int) -> _Pin | None:
        d, shard = self._unit(uid)
        fd = self._open_lock(d.id, shard)
        if _flock(fd, fcntl.LOCK_SH):
            if self._present(uid):
                return _Pin(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
        _close_fd(fd)
        return None

    def _heartbeat(self, uid: int) -> int:
        """The mtime of the unit's lock file: a download touches it as bytes arrive (an empty
        file: nothing the limit has to count)."""
        d, shard = self._unit(uid)
        try:
            return os.lstat(self._lock_path(d.id, shard)).st_mtime_ns
        except OSError:
            return 0

    def _generation(self) -> int:
        """The index's generation (0: no index). Read through a descriptor kept per process:
        the index is rewritten in place; one that was removed is opened again."""
        st = self._proc()
        try:
            if st.gen_fd < 0 or os.fstat(st.gen_fd).st_nlink == 0:
                if st.gen_fd >= 0:
                    _close_fd(st.gen_fd)
                    st.gen_fd = -1
                st.gen_fd = open_private(os.path.join(self.cache_dir, ".index"), os.O_RDONLY)
                _FDS.add(st.gen_fd)
            head = os.pread(st.gen_fd, 16, 0)
        except OSError:
            return 0
        return int.from_bytes(head[8:16], "little") if len(head) == 16 else 0

    def _acquire(self, uid: int) -> _Pin:
        st = self._proc()
        pin = self._try_pin(uid)
        if pin is not None:
            return pin
        timeout = self.options.timeout
        t0 = time.monotonic()
        self._block(st, True)
        self._touch(st, want=uid)
        # With a fetcher process, let it download (it sees `want`); only if it has not got
        # the unit after grace_s (or is gone) does this process fetch it itself.
        delegate = t0 + self.options.grace_s if self.fetcher_alive() else t0
        try:
            fut: Future[str] | None = None
            status = "queued"
            seen = (-1, -1, "")
            last = t0
            nap = 0.001
            while True:
                now = time.monotonic()
                own = now >= delegate or not self.fetcher_alive()
                if own and (fut is None or fut.done()):
                    if fut is not None and not fut.cancelled():
                        status = fut.result()  # a failed download raises here, naming the URL
                        if status == "noroom":
                            self._unpin_all()
                    fut = st.pool.submit(uid, self._abs(*st.pos))
                pin = self._try_pin(uid)
                if pin is not None:
                    return pin
                mark = (self._heartbeat(uid), self._generation(), status)
                if mark != seen:
                    seen, last = mark, now
                elif now - last > timeout:
                    self._stalled(uid, status, now - last)
                self._touch(st)
                if fut is None or status in ("busy", "noroom") or fut.done():
                    # another process has it, or room is awaited: poll, waking at once when
                    # a download in flight (the unit's lock held) finishes
                    self._nap(st, uid, nap)
                    nap = min(nap * 2, 0.01 if fut is None else 0.05)
                else:
                    wait([fut], timeout=0.05)  # our own thread downloads it: wake when done
        finally:
            self._touch(st, want=-1)
            self._block(st, False)

    def _nap(self, st: _Proc, uid: int, secs: float) -> None:
        """Sleep up to ``secs``; return as soon as the unit's lock is released if another
        process holds it (downloading or evicting it). Measured: polling alone left a reader
        waiting 4.6 ms on average after the download it waited for was published.

        The wake-up is a thread blocked in ``flock(LOCK_SH)`` on its own descriptor (a lock
        cannot be waited for with a timeout); one per process and unit, kept across naps
        until the lock is released, so a stalled download never piles up threads."""
        ev = st.wakers.get(uid)
        if ev is None:
            d, shard = self._unit(uid)
            fd = self._open_lock(d.id, shard)
            if _flock(fd, fcntl.LOCK_SH):  # nobody holds it: nothing to wake on
                fcntl.flock(fd, fcntl.LOCK_UN)
                _close_fd(fd)
                time.sleep(secs)
                return
            ev = st.wakers[uid] = threading.Event()

            def waker(fd: int = fd, ev: threading.Event = ev) -> None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # blocks until the holder lets go
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError:
                    pass  # closed by a fork hook or at exit: just wake the reader
                finally:
                    ev.set()
                    with contextlib.suppress(OSError):
                        _close_fd(fd)

            threading.Thread(target=waker, name="unbroken-cache-wake", daemon=True).start()
        if ev.wait(secs):
            st.wakers.pop(uid, None)

    def _stalled(self, uid: int, status: str, secs: float) -> None:
        d, shard = self._unit(uid)
        url = join_path(d.url, d.manifest.shards[shard].name)
        if status == "noroom":
            used = self._used()
            raise RuntimeError(
                f"{url}: no room in the cache for {secs:.0f}s: {used:,} of cache_limit="
                f"{self.limit:,} bytes are held by shards other readers of this node have open "
                "or need sooner (readers far apart - ranks out of step?); raise cache_limit or "
                "lower CacheOptions(prefetch_shards)"
            )
        raise RemoteStorageError(
            f"{url}: download made no progress for {secs:.0f}s (CacheOptions.timeout="
            f"{self.options.timeout:g}); the storage is unreachable or stalled - check it, then "
            "resume"
        )

    # --- registration and accounting ------------------------------------------------------

    def _register(self, st: _Proc, epoch: int, pos: int) -> None:
        if st.reg_fd < 0:
            path = os.path.join(self.cache_dir, ".readers", f"{st.pid}-{id(self):x}")
            st.reg_fd = _open_fd(path)
            fcntl.flock(st.reg_fd, fcntl.LOCK_SH)  # alive while held
            os.pwrite(st.reg_fd, np.array([-1], dtype=np.int64).tobytes(), 32)
        os.pwrite(
            st.reg_fd,
            np.array([self.ds_id, epoch, pos, time.monotonic_ns()], dtype=np.int64).tobytes(),
            0,
        )

    def _touch(self, st: _Proc, want: int | None = None) -> None:
        """Heartbeat while waiting; ``want``: the unit this reader waits for (-1: none)."""
        if st.reg_fd >= 0:
            os.pwrite(st.reg_fd, np.array([time.monotonic_ns()], dtype=np.int64).tobytes(), 24)
            if want is not None:
                os.pwrite(st.reg_fd, np.array([want], dtype=np.int64).tobytes(), 32)

    def _registrations(self) -> list[tuple[int, int, int]]:
        """(epoch, position, wanted unit or -1) of this dataset's live, recently active
        readers on the node; registrations of dead readers are removed."""
        rdir = os.path.join(self.cache_dir, ".readers")
        now = time.monotonic_ns()
        stale = int(self.options.timeout * 1e9)
        out: list[tuple[int, int, int]] = []
        try:
            names = os.listdir(rdir)
        except FileNotFoundError:
            return out  # the cache directory was removed
        for name in names:
            path = os.path.join(rdir, name)
            try:
                fd = open_private(path, os.O_RDWR)
            except OSError:
                continue
            try:
                if _flock(fd, fcntl.LOCK_EX):  # nobody holds it: its reader is gone
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    continue
                raw = os.pread(fd, 40, 0)
            finally:
                os.close(fd)
            if len(raw) != 40:
                continue
            ds_id, epoch, pos, beat, want = np.frombuffer(raw, dtype=np.int64).tolist()
            if ds_id != self.ds_id or epoch < 0 or now - beat > stale:
                continue  # another dataset, or a reader idle for long (it re-registers)
            out.append((epoch, pos, want))
        return out

    def _frame(self) -> tuple[int, int, int]:
        """(epoch, position) of this dataset's slowest live reader on the node, and the
        latest epoch any of them is in."""
        st = self._proc()
        regs = [(e, p) for e, p, _ in self._registrations()]
        if not regs:
            regs = [(max(st.pos[0], 0), st.pos[1])]
        e0, p0 = min(regs)
        return e0, p0, max(e for e, _ in regs)

    # --- the fetcher process ----------------------------------------------------------------

    def _fetch_lock(self) -> str:
        return os.path.join(self.cache_dir, ".fetch", _dir_name(self.ds_id) + ".lock")

    def fetcher_alive(self) -> bool:
        """Whether a fetcher process serves this dataset on this node (it holds its lock)."""
        st = self._proc()
        now = time.monotonic()
        if now < st.fetcher_checked + 0.5:
            return st.fetcher_up
        st.fetcher_checked = now
        lock = self._fetch_lock()
        try:
            fd = open_private(lock, os.O_RDONLY)
        except FileNotFoundError:
            st.fetcher_up = False
        else:
            try:
                st.fetcher_up = not _flock(fd, fcntl.LOCK_SH)
            finally:
                os.close(fd)
        if not st.fetcher_up and self.options.fetch_process and now > st.fetcher_spawned + 5.0:
            st.fetcher_spawned = now
            self._spawn_fetcher()
        return st.fetcher_up

    def _spawn_fetcher(self, fresh: bool | None = None) -> None:
        """Start a fetcher: forked from this process, or (``fresh``; the default in a
        DataLoader worker, which may not fork children) a new interpreter."""
        import multiprocessing
        import pickle
        import subprocess
        import sys

        lock = self._fetch_lock()
        me = dict(self.__dict__)
        me.update(readers=[], _state=None, _plan_lock=threading.Lock(), _plans=OrderedDict())
        clone = object.__new__(RemoteCache)
        clone.__dict__.update(me)
        _CHILDREN[:] = [c for c in _CHILDREN if c.poll() is None]  # reap finished ones
        if fresh is None:
            fresh = bool(multiprocessing.current_process().daemon)
        if not fresh:
            # A fork starts in milliseconds with everything imported (a fresh interpreter
            # takes a second or more to import numpy and s3fs); daemonic, so it goes when
            # this process exits. Forked like a DataLoader worker, and like one it never
            # touches CUDA.
            child = multiprocessing.get_context("fork").Process(
                target=clone.serve, name="unbroken-fetcher", daemon=True
            )
            child.start()
            _CHILDREN.append(_Forked(child))
            return
        # A DataLoader worker may not fork children of its own: a fresh interpreter. Its
        # state goes over a pipe, never through a file: a file in a cache directory others
        # can write to would let them run code in the fetcher when it is unpickled.
        clone.__setstate__(clone.__getstate__())
        payload = pickle.dumps(clone)
        # its log: a fixed name (never followed), started afresh when it reached its bound;
        # the fetcher keeps it within _LOG_MAX (counted at that size in the limit)
        err = open_private(lock[: -len(".lock")] + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            if os.fstat(err).st_size > _LOG_MAX // 2:
                os.ftruncate(err, 0)
            proc = subprocess.Popen(
                [sys.executable, "-m", "unbroken.data.stream.fetcher"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                close_fds=True,
            )
        finally:
            os.close(err)
        _CHILDREN.append(proc)
        # written from a thread: the child reads it all once its interpreter is up
        threading.Thread(
            target=_feed, args=(proc.stdin, payload), name="unbroken-fetcher-feed", daemon=True
        ).start()

    def serve(self, idle_exit: float = 10.0) -> None:
        """The fetcher process's loop: prefetch for every live reader of this dataset on the
        node, fetch first what a reader waits for; return when nobody has read for
        ``idle_exit`` seconds, when the cache directory is gone, or when another fetcher
        already serves. A failed download is the readers' to report (they retry it
        themselves after ``grace_s``), so nothing here raises."""
        try:
            self._serve(idle_exit)
        except FileNotFoundError:
            pass  # the cache directory was removed under us
        except Exception:
            log.exception("fetcher for %s stopped", self.cache_dir)

    def _serve(self, idle_exit: float) -> None:
        lock = self._fetch_lock()
        fd = _open_fd(lock)
        if not _flock(fd, fcntl.LOCK_EX):
            return
        self._event("fetcher", state="start")
        st = self._proc()
        idle_since = time.monotonic()
        last: dict[tuple[int, int], tuple[int, float]] = {}
        seen: list[tuple[int, int, int]] = []
        nap = 0.005
        while os.path.isdir(self.cache_dir):
            regs = sorted(self._registrations())
            now = time.monotonic()
            if regs:
                idle_since = now
            elif now - idle_since > idle_exit:
                return
            for epoch, pos, want in regs:
                if 0 <= want < self.unit_bytes.size and not st.pool.busy(want):
                    st.pool.submit(want, self._abs(epoch, pos) - 1)  # ahead of everything
            for epoch, pos in sorted({(e, p) for e, p, _ in regs}):
                bound, t = last.get((epoch, pos // 1024), (-1, 0.0))
                if pos < bound and now - t < 0.05:
                    continue
                st.pos = (epoch, pos)
                last[(epoch, pos // 1024)] = (self._prefetch(st, self.plan(epoch), pos), now)
            if len(last) > 4096:
                last.clear()
            # poll fast while readers move, slowly while nothing changes
            nap = 0.02 if regs != seen else min(nap * 2, 0.1)
            seen = regs
            time.sleep(nap)

    def _block(self, st: _Proc, on: bool) -> None:
        if st.slot is None:
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            owner = os.getppid() if info is not None else os.getpid()
            st.slot_mm, slots = _map_stats(_stats_path(self.cache_dir, owner))
            st.slot = slots[(info.id if info is not None else 0) % _SLOTS]
        now = time.monotonic_ns()
        if on:
            st.slot[1] = now
        else:
            since = int(st.slot[1])
            if since > 0:
                st.slot[0] += now - since
            st.slot[1] = 0

    def _sweep_stats(self) -> None:
        sdir = os.path.join(self.cache_dir, ".stats")
        for name in os.listdir(sdir):
            if not name.isdigit():
                continue
            try:
                os.kill(int(name), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(sdir, name))
            except PermissionError:
                pass

    def _event(self, kind: str, **fields: Any) -> None:
        """Append one line to ``.events``; rotated to ``.events.1`` before it would pass
        :data:`EVENTS_MAX`, under a lock on the file, so the log never holds more than twice
        that."""
        line = (
            json.dumps(
                {"t": round(time.time(), 6), "ev": kind, "pid": os.getpid(), **fields},
                separators=(",", ":"),
            )
            + "\n"
        ).encode()
        path = os.path.join(self.cache_dir, ".events")
        for _ in range(8):  # another writer rotated it between our open and our lock: again
            fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                here = os.fstat(fd)
                try:
                    now = os.lstat(path)
                except FileNotFoundError:
                    continue
                if (now.st_dev, now.st_ino) != (here.st_dev, here.st_ino):
                    continue
                if here.st_size and here.st_size + len(line) > EVENTS_MAX:
                    os.replace(path, path + ".1")
                    continue
                os.write(fd, line)  # one O_APPEND write per event: lines never interleave
                return
            finally:
                os.close(fd)

    # --- the index ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[tuple[int, np.ndarray]]:
        """The index under the node-wide lock: yields (generation, records); write it back
        with :meth:`_write` inside the block."""
        st = self._proc()
        with st.lock:
            deadline = time.monotonic() + self.options.timeout
            nap = 0.0005
            while not _flock(st.index_fd, fcntl.LOCK_EX):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.cache_dir}/.lock: held by another process for more than "
                        f"{self.options.timeout:g}s (a reader stopped with SIGSTOP?); the cache "
                        "cannot be updated"
                    )
                time.sleep(nap)
                nap = min(nap * 2, 0.02)
            try:
                yield self._read_index()
            finally:
                fcntl.flock(st.index_fd, fcntl.LOCK_UN)

    def _read_index(self) -> tuple[int, np.ndarray]:
        path = os.path.join(self.cache_dir, ".index")
        try:
            data = _read_private(path)
        except FileNotFoundError:
            data = b""
        got = _unpack_index(data)
        if got is None:
            if data:
                log.warning("%s: damaged cache index; rebuilding it from the files", path)
            got = (1, self._rebuild())
            self._write(*got)
        return got

    def _write(self, gen: int, rec: np.ndarray) -> None:
        path = os.path.join(self.cache_dir, ".index")
        data = _pack_index(gen, rec)
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)

    def _rebuild(self) -> np.ndarray:
        """Records for the complete units found on disk; partial files of units nobody holds
        are deleted."""
        rows = []
        for name in sorted(os.listdir(self.cache_dir)):
            local = os.path.join(self.cache_dir, name)
            if len(name) != 16 or not os.path.isdir(local):
                continue
            try:
                dir_id = _dir_id(name)
                m = _load_manifest(local)
            except (OSError, ValueError):
                continue
            names = {}
            for k, s in enumerate(m.shards):
                names[s.name] = names[s.index] = k
            complete = set()
            for k, s in enumerate(m.shards):
                files = self._files(dir_id, k) or []
                if self._complete(files):  # verified when first used (issue 20 item 8)
                    rows.append((dir_id, k, s.bytes + s.index_bytes, _FOUND, 0))
                    complete.add(k)
            for f in os.listdir(local):
                base = f[len(".tmp-") :].rsplit(".", 1)[0] if is_temp_name(f) else f
                unit = names.get(base)
                if unit is None or (f == base and unit in complete):
                    continue
                self._discard_if_free(dir_id, unit, [os.path.join(local, f)])
        return np.array(rows, dtype=np.int64).reshape(-1, _COLS)

    def _discard_if_free(self, dir_id: int, shard: int, paths: list[str]) -> bool:
        fd = self._open_lock(dir_id, shard)
        try:
            if not _flock(fd, fcntl.LOCK_EX):
                return False
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
                    self._event(
                        "discard", dir=_dir_name(dir_id), shard=shard, file=os.path.basename(p)
                    )
            return True
        finally:
            _close_fd(fd)

    def _temps(self, dir_id: int, shard: int) -> list[str]:
        files = self._files(dir_id, shard) or []
        if not files:
            return []
        local = os.path.dirname(files[0][0])
        want = {".tmp-" + os.path.basename(p) + "." for p, _ in files}
        try:
            names = os.listdir(local)
        except OSError:
            return []
        return [
            os.path.join(local, n)
            for n in names
            if is_temp_name(n) and any(n.startswith(w) for w in want)
        ]

    def _clean_reserved(self, rec: np.ndarray, skip: int) -> tuple[np.ndarray, bool]:
        """Reservations whose downloader died (its unit lock is free): a unit it completed
        is found (verified when first used), anything partial is deleted."""
        changed = False
        keep = np.ones(rec.shape[0], dtype=bool)
        for k in np.flatnonzero(rec[:, 3] == _RESERVED).tolist():
            dir_id, shard = int(rec[k, 0]), int(rec[k, 1])
            if (dir_id, shard) == self._key(skip):
                continue
            fd = self._open_lock(dir_id, shard)
            try:
                if not _flock(fd, fcntl.LOCK_EX):
                    continue  # still downloading
                files = self._files(dir_id, shard) or []
                if self._complete(files):
                    rec[k, 3], rec[k, 4] = _FOUND, 0
                else:
                    for p in [f for f, _ in files] + self._temps(dir_id, shard):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(p)
                    keep[k] = False
                    self._event(
                        "discard", dir=_dir_name(dir_id), shard=shard, file="partial download"
                    )
                changed = True
            finally:
                _close_fd(fd)
        return rec[keep], changed

    def _key(self, uid: int) -> tuple[int, int]:
        if uid < 0:
            return (0, -1)
        d, shard = self._unit(uid)
        return d.id, shard

    # --- downloading ----------------------------------------------------------------------

    def _fetch(self, uid: int, prio: int) -> str:
        """Bring one unit into the cache if nobody else is and the cache admits it (runs in
        the pool): its files found on disk are verified, else downloaded verified. Returns
        "present", "busy" (another process has it), "noroom" or "done"."""
        st = self._proc()
        d, shard = self._unit(uid)
        fd = self._open_lock(d.id, shard)
        try:
            if not _flock(fd, fcntl.LOCK_EX):
                st.retry_after[uid] = time.monotonic() + 0.02
                return "busy"
            if self._present(uid):
                return "present"
            files = self._files(d.id, shard) or []
            for tmp in self._temps(d.id, shard):  # left by a downloader that died: we hold
                with contextlib.suppress(FileNotFoundError):  # the unit, nobody writes them
                    os.unlink(tmp)
            if not self._reserve(uid, prio):
                self._unlink(files)  # found there but not counted (no record): not kept
                st.retry_after[uid] = time.monotonic() + 0.02
                return "noroom"
            t0 = time.monotonic()
            found = self._complete(files) and self._verify_found(d, shard, files)
            if not found:
                try:
                    self._download(st, fd, d, shard, files)
                except BaseException:
                    self._unlink(files)
                    self._unreserve(uid)
                    raise
            self._commit(uid, prio, time.monotonic() - t0, files, found)
            return "done"
        finally:
            _close_fd(fd)

    @staticmethod
    def _unlink(files: list[tuple[str, int]]) -> None:
        for path, _ in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _verify_found(self, d: _Dir, shard: int, files: list[tuple[str, int]]) -> bool:
        """Files of a unit found on disk (not downloaded by a verified fetch, or changed
        since): they must match the whole-file checksums of dataset.json before any sample
        is read from them (issue 20 item 8). A mismatch is discarded (and downloaded again)."""
        info = d.manifest.shards[shard]
        for (path, size), want in zip(files, (info.checksum, info.index_checksum), strict=True):
            try:
                got = checksum_file(path)
            except OSError:
                got = (-1, "")
            if got != (size, want):
                self._unlink(files)
                self._event(
                    "discard",
                    dir=d.name,
                    shard=shard,
                    file=os.path.basename(path),
                    why="checksum differs from dataset.json",
                )
                return False
        return True

    def _download(
        self, st: _Proc, fd: int, d: _Dir, shard: int, files: list[tuple[str, int]]
    ) -> None:
        info = d.manifest.shards[shard]
        fs, root = self._fs(d)

        def on_bytes(n: int) -> None:
            if st.pool.stopping:
                raise _Stopped
            os.utime(fd)  # the heartbeat: the lock file's mtime

        for (path, size), name, checksum in zip(
            files, (info.name, info.index), (info.checksum, info.index_checksum), strict=True
        ):
            fetch_verified(
                fs,
                root.rstrip("/") + "/" + name,
                path,
                size,
                checksum,
                url=join_path(d.url, name),
                retries=self.options.retries,
                backoff_s=self.options.backoff_s,
                on_bytes=on_bytes,
                what="caching",
                private=True,
            )

    def _reserve(self, uid: int, prio: int) -> bool:
        """Hold room for ``uid`` in the budget, evicting units needed later than ``prio``
        (farthest first) if that makes room; False (nothing evicted) if it cannot. A unit
        already counted (found on disk, or a ready record whose files changed) keeps its
        room."""
        need = int(self.unit_bytes[uid])
        key = self._key(uid)
        with self._locked() as (gen, rec):
            rec, changed = self._clean_reserved(rec, uid)
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1])
            held = np.array([[*key, need, _RESERVED, 0]], dtype=np.int64)
            if mine.any():
                self._write(gen + 1, np.concatenate([rec[~mine], held]))
                return True
            victims: list[tuple[int, int]] | None = []  # (record row, locked fd)
            if self.limit is not None:
                short = self._used(rec, extra=1) + need - self.limit
                if short > 0:
                    victims = self._choose(rec, prio, short)
            if victims is None:
                if changed:
                    self._write(gen + 1, rec)
                return False
            rec = self._evict(rec, victims)
            self._write(gen + 1, np.concatenate([rec, held]))
            return True

    def _evict(self, rec: np.ndarray, victims: list[tuple[int, int]]) -> np.ndarray:
        """Delete the victims' files (their locks held) and drop their records."""
        drop = np.zeros(rec.shape[0], dtype=bool)
        for row, vfd in victims:
            dir_id, shard = int(rec[row, 0]), int(rec[row, 1])
            try:
                self._unlink(self._files(dir_id, shard) or [])
            finally:
                _close_fd(vfd)
            drop[row] = True
            self._event(
                "evict",
                dir=_dir_name(dir_id),
                shard=shard,
                bytes=int(rec[row, 2]),
                epoch=self._proc().pos[0],
            )
        return rec[~drop]

    def _choose(self, rec: np.ndarray, prio: int, short: int) -> list[tuple[int, int]] | None:
        """Ready (or found) units, not open anywhere, needed later than ``prio``: the
        farthest first until ``short`` bytes are free. Returns (row, fd holding LOCK_EX) or
        None."""
        ready = np.flatnonzero(rec[:, 3] != _RESERVED)
        if ready.size == 0:
            return None
        nu = np.full(ready.size, _NEVER, dtype=np.int64)
        uid = np.full(ready.size, -1, dtype=np.int64)
        for d in self.dirs:
            m = (rec[ready, 0] == d.id) & (rec[ready, 1] < len(d.manifest.shards))
            uid[m] = rec[ready[m], 1] + d.base
        ours = uid >= 0
        if ours.any():
            e0, p0, top = self._frame()
            left = np.ones(int(ours.sum()), dtype=bool)
            val = np.full(left.size, _NEVER, dtype=np.int64)
            for e in range(e0, min(top, e0 + 2) + 2):
                if not left.any():
                    break
                got = self.plan(e).next_use(uid[ours], p0 if e == e0 else 0)
                hit = left & (got != _NEVER)
                val[hit] = got[hit]
                left &= ~hit
            nu[ours] = val
        order = np.argsort(-nu, kind="stable")
        held: list[tuple[int, int]] = []
        freed = 0
        for j in order.tolist():
            if nu[j] <= prio:
                break  # everything left is needed no later than the unit asking for room
            row = int(ready[j])
            fd = self._open_lock(int(rec[row, 0]), int(rec[row, 1]))
            if not _flock(fd, fcntl.LOCK_EX):
                _close_fd(fd)  # open by a reader (or being evicted): not a candidate
                continue
            held.append((row, fd))
            freed += int(rec[row, 2])
            if freed >= short:
                return held
        for _, fd in held:
            _close_fd(fd)
        return None

    def _commit(
        self, uid: int, prio: int, secs: float, files: list[tuple[str, int]], found: bool
    ) -> None:
        """The unit is verified: ready, with the stamp of the files that were verified."""
        key = self._key(uid)
        row = np.array([[*key, self.unit_bytes[uid], _READY, _stamp(files)]], dtype=np.int64)
        with self._locked() as (gen, rec):
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1])
            # (no record: the index was rebuilt while this download ran)
            self._write(gen + 1, np.concatenate([rec[~mine], row]))
        s = self.length + 1
        self._event(
            "verify" if found else "download",
            dir=_dir_name(key[0]),
            shard=key[1],
            bytes=int(self.unit_bytes[uid]),
            epoch=self._proc().pos[0],
            for_epoch=(prio + 1) // s,
            secs=round(secs, 4),
        )

    def _unreserve(self, uid: int) -> None:
        key = self._key(uid)
        with self._locked() as (gen, rec):
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1])
            self._write(gen + 1, rec[~mine])

    # --- introspection ----------------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """(bytes accounted in the cache, units in it)."""
        with self._locked() as (_, rec):
            return int(rec[:, 2].sum()), int(rec.shape[0])

    def fetch(self, uids: Sequence[int], prio: int = 0) -> list[str]:
        """Download ``uids`` now with the pool (blocking); used by ``data bench``."""
        st = self._proc()
        futs = [st.pool.submit(int(u), prio) for u in uids]
        return [f.result(timeout=self.options.timeout * (self.options.retries + 2)) for f in futs]


def check_cache_args(
    roots: Sequence[str], cache_dir: str | None, cache_limit: int | str | None
) -> int | None:
    """Validate the cache arguments before anything is read; returns the limit in bytes."""
    remote = [r for r in roots if is_remote(r)]
    limit = None if cache_limit is None else parse_size(cache_limit)
    if remote and cache_dir is None:
        raise ValueError(
            f"{remote[0]}: a remote dataset is read through a local cache; pass "
            "cache_dir='/nvme/cache' (local disk, shared by the ranks of a node) and "
            "cache_limit='200GB' (or stage it first with `unbroken data stage URL DIR`)"
        )
    if not remote and (cache_dir is not None or cache_limit is not None):
        log.info("cache_dir/cache_limit ignored: every source is a local directory")
    return limit


def open_cache(
    ds: Any,
    cache_dir: str | None,
    cache_limit: int | str | None,
    options: CacheOptions | None,
    storage_options: dict[str, Any] | None,
) -> RemoteCache | None:
    """Attach a :class:`RemoteCache` to ``ds``'s remote sources; None when all are local."""
    limit = check_cache_args([s.root for s in ds.sources], cache_dir, cache_limit)
    if cache_dir is None or not any(is_remote(s.root) for s in ds.sources):
        return None
    cache = RemoteCache(ds, cache_dir, limit, options or CacheOptions(), storage_options)
    cache.fetcher_alive()  # starts the fetcher now: it is up when the first reader registers
    return cache


def read_events(cache_dir: str) -> list[dict[str, Any]]:
    """The cache's event log (downloads, evictions, discarded partial files), oldest first."""
    out = []
    for name in (".events.1", ".events"):
        try:  # bounded files, fixed names: never through a symlink
            raw = _read_private(os.path.join(cache_dir, name))
        except FileNotFoundError:
            continue
        for line in raw.decode("utf-8", "replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def _feed(pipe: Any, payload: bytes) -> None:
    """Write ``payload`` into a child's stdin and close it (a child that died first: nothing
    to do; its readers start another)."""
    try:
        pipe.write(payload)
        pipe.close()
    except OSError:
        pass
