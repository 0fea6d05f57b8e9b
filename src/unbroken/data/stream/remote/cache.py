""":class:`RemoteCache`: a dataset's remote sources read through the node's bounded cache.

The readers of a node (its ranks and their DataLoader workers) each hold one; they share the
cache directory, its index, its unit locks and one fetcher process per dataset. A reader
:meth:`~RemoteCache.advance`-s to the positions it reads next (which registers it, releases
what it no longer needs, and starts the downloads it will need), then
:meth:`~RemoteCache.open`-s the shards under them: each waits for its unit, pins it, and is
opened by the reader's own opener. See :mod:`unbroken.data.stream.remote` for the design.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import xxhash

from unbroken.common.fs import close_lock_fd, is_remote, open_lock_fd, private_dir
from unbroken.data.manifest import DatasetManifest, join_path
from unbroken.data.stream.config import CacheConfig, DatasetConfig
from unbroken.data.stream.order import NEVER, DatasetOrder, EpochPlan
from unbroken.data.stream.remote import fetch, fetcher, plan
from unbroken.data.stream.remote.events import EventLog
from unbroken.data.stream.remote.index import INDEXED, dir_id, dir_name, write_private
from unbroken.data.stream.remote.locks import Pin, PinnedShard, UnitLocks, try_flock
from unbroken.data.stream.remote.pool import Pool
from unbroken.data.stream.remote.probe import WaitSlot, sweep_stats
from unbroken.data.stream.remote.readers import Registration, live_readers, reader_records
from unbroken.data.stream.remote.units import Files, UnitStore

__all__ = [
    "RemoteCache",
    "RemoteSource",
    "ShardHolder",
    "check_cache_config",
    "fit_cache",
    "open_cache",
]

log = logging.getLogger(__name__)

_PLANS = 4  # epoch plans kept per process
_STOP_S = 2.0  # s a process on its way out waits for its downloads to abort
T = TypeVar("T")


@dataclass(frozen=True)
class RemoteSource:
    """A source of the dataset at a URL: its index among the dataset's sources, its manifest."""

    index: int
    url: str
    manifest: DatasetManifest


class ShardHolder(Protocol):
    """What keeps a source's shards open (a dataset's reader): the cache closes, through it,
    the shards no read needs any more (their pins then let the units go)."""

    def open_shards(self) -> list[int]: ...

    def close_shards(self, shards: Iterable[int]) -> None: ...


@dataclass(frozen=True)
class _Dir:
    """One remote dataset (a manifest) in the cache."""

    id: int
    name: str
    url: str
    manifest: DatasetManifest
    options: dict[str, Any]  # fsspec storage options, with timeouts
    base: int  # unit of its shard 0


class _Proc:
    """What belongs to one process (made again after a fork into a DataLoader worker)."""

    def __init__(self, cache: RemoteCache) -> None:
        self.pid = os.getpid()
        self.pool = Pool(cache.config.threads, cache._fetch, "unbroken-cache")
        self.stores: dict[int, fetch.ObjectStore] = {}
        self.retry_after: dict[int, float] = {}
        self.fetcher_up = False
        self.fetcher_checked = -1e9
        self.fetcher_spawned = -1e9
        self.pos = (-1, 0)
        self.next_eval = (-1, -1, 0.0)  # (epoch, boundary position, time) of the prefetch plan
        # On exit, abort the downloads in flight so that they leave no partial file or
        # reservation behind (a DataLoader worker exits through multiprocessing, which runs
        # its finalizers but not atexit).
        import multiprocessing
        import multiprocessing.util as mpu

        if multiprocessing.parent_process() is not None:
            mpu.Finalize(self, self.pool.stop, args=(_STOP_S,), exitpriority=100)
        else:
            atexit.register(self.pool.stop, _STOP_S)


class RemoteCache:
    """The node-local cache of a dataset's remote sources (see the module docstring). Built by
    :func:`open_cache`; per process, it owns a download pool, a reader registration and a
    network-wait slot."""

    def __init__(
        self, order: DatasetOrder, sources: Sequence[RemoteSource], config: CacheConfig
    ) -> None:
        if config.cache_dir is None:
            raise ValueError("RemoteCache needs CacheConfig.cache_dir (a local directory)")
        self.cache_dir = private_dir(os.path.abspath(config.cache_dir), purpose="cache directory")
        self.config = config
        self.limit = config.limit_bytes
        self.order = order.clone()  # planning here must not evict the reader's windows
        self.ds_id = dir_id(xxhash.xxh3_64_hexdigest(order.fingerprint.encode()))
        self.length = order.length
        self.dirs: list[_Dir] = []
        self.src_dir: dict[int, _Dir] = {}
        for s in sources:
            d = next(
                (x for x in self.dirs if x.manifest.fingerprint == s.manifest.fingerprint), None
            )
            if d is None:
                opts = fetch.with_timeouts(s.url, config.storage_options, config.timeout)
                m = s.manifest
                base = sum(len(x.manifest.shards) for x in self.dirs)
                d = _Dir(dir_id(m.fingerprint), m.fingerprint[:16], s.url, m, opts, base)
                self.dirs.append(d)
            self.src_dir[s.index] = d
        self._by_id = {d.id: d for d in self.dirs}
        n = sum(len(d.manifest.shards) for d in self.dirs)
        self.unit_bytes = np.zeros(n, dtype=np.int64)
        self.unit_dir = np.zeros(n, dtype=np.int64)
        for d in self.dirs:
            sl = slice(d.base, d.base + len(d.manifest.shards))
            self.unit_bytes[sl] = [s.bytes + s.index_bytes for s in d.manifest.shards]
            self.unit_dir[sl] = d.id
        self.events = EventLog(self.cache_dir)
        self.locks = UnitLocks(self.cache_dir)
        manifests = {d.id: d.manifest for d in self.dirs}
        self.units = UnitStore(
            self.cache_dir, manifests, self.limit, config.timeout, self.locks, self.events
        )
        self.registration = Registration(
            self.cache_dir, self.ds_id, f"{id(self):x}", self.fetch_path(".wake")
        )
        self.slot = WaitSlot(self.cache_dir)
        wrote = self._make_dirs()
        self._holders: dict[int, ShardHolder] = {}
        self._plans: OrderedDict[int, EpochPlan] = OrderedDict()
        self._plan_lock = threading.Lock()
        self._state: _Proc | None = None
        window = sum(plan.window_units(order, i) for i in self.src_dir)
        # the default read-ahead goes one window into the next epoch, not deeper: near an
        # epoch's end a deeper one is downloaded in this epoch (issue 22 round 3: 1.10-1.11x
        # the dataset in epoch 1 with 1.5 windows); a prefetch_shards given is kept
        self.next_epoch_ahead = window if config.prefetch_shards is None else None
        self.prefetch_shards = (
            config.prefetch_shards if config.prefetch_shards is not None else window
        )
        self._check_limit()
        if config.prefetch_shards is None:
            biggest = int(self.unit_bytes.max()) if self.unit_bytes.size else 1
            need = self.min_limit()[0]
            self.prefetch_shards = plan.default_depth(window, self.limit, need, biggest)
        for d in self.dirs:  # before any download thread or fork (fetch.import_request_path)
            fetch.import_request_path(d.url, d.options, self.config)
        sweep_stats(self.cache_dir)
        self.units.sweep()  # what dead downloads left (a run killed, a fetcher ended mid-GET)
        if wrote:
            self.units.make_room(self._next_use)

    def _make_dirs(self) -> bool:
        """The cache's private directories and this dataset's manifest copies; whether one
        was written."""
        for sub in (".locks", ".readers", ".stats", ".fetch"):
            private_dir(os.path.join(self.cache_dir, sub), purpose="cache directory")
        wrote = False
        for d in self.dirs:
            local = private_dir(os.path.join(self.cache_dir, d.name), purpose="cache directory")
            if not os.path.lexists(os.path.join(local, "dataset.json")):
                write_private(os.path.join(local, "dataset.json"), d.manifest.dumps().encode())
                wrote = True
        return wrote

    # --- per process ----------------------------------------------------------------------

    def _proc(self) -> _Proc:
        st = self._state
        if st is None or st.pid != os.getpid():
            if st is not None:
                # Forked: the parent's threads are gone and its descriptors were closed by
                # the fork hook. Close the shards the parent had open: their maps would keep
                # evicted bytes on disk.
                for h in self._holders.values():
                    h.close_shards(h.open_shards())
                self._plan_lock = threading.Lock()
            st = self._state = _Proc(self)
        return st

    def __getstate__(self) -> dict[str, Any]:
        # (the holders travel along: a worker started by spawn gets its own readers)
        return {**self.__dict__, "_state": None, "_plan_lock": None, "_plans": OrderedDict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plan_lock = threading.Lock()

    def detached(self) -> RemoteCache:
        """A copy without this process's state or readers (what a fetcher process runs)."""
        twin = object.__new__(RemoteCache)
        twin.__setstate__({**self.__getstate__(), "_holders": {}})
        return twin

    def _store(self, d: _Dir) -> fetch.ObjectStore:
        st = self._proc()
        hit = st.stores.get(d.id)
        if hit is None:
            hit = st.stores[d.id] = fetch.open_store(d.url, d.options, self.config)
        return hit

    # --- units ----------------------------------------------------------------------------

    def _unit(self, uid: int) -> tuple[_Dir, int]:
        d = self._by_id[int(self.unit_dir[uid])]
        return d, uid - d.base

    def _key(self, uid: int) -> tuple[int, int]:
        d, shard = self._unit(uid)
        return d.id, shard

    def _present(self, uid: int) -> bool:
        return self.units.present(*self._key(uid))

    def _abs(self, epoch: int, pos: int) -> int:
        return epoch * (self.length + 1) + pos

    # --- the limit ------------------------------------------------------------------------

    def window_units(self, i: int) -> int:
        return plan.window_units(self.order, i)

    def min_limit(self) -> tuple[int, str]:
        """Bytes the cache must hold at least, and how that figure is made up."""
        units = {
            i: self.unit_bytes[d.base : d.base + len(d.manifest.shards)]
            for i, d in self.src_dir.items()
        }
        manifests = sum(len(d.manifest.dumps()) for d in self.dirs)
        return plan.min_limit(
            self.order, units, self.prefetch_shards, self.config.cap_bytes, manifests
        )

    def _check_limit(self) -> None:
        need, why = self.min_limit()
        if self.limit is None:
            return
        if self.limit < need:
            raise ValueError(
                f"cache_limit={self.limit:,} bytes is too small: {why}; pass cache_limit >= "
                f"{need:,} (or a smaller shuffle_window, or CacheConfig(prefetch_shards=...))"
            )
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(self.cache_dir).free
            if free + self.units.used() < self.limit:
                log.warning(
                    "%s: cache_limit=%s bytes but only %s bytes are free there; downloads "
                    "will fail with a full disk first",
                    self.cache_dir,
                    f"{self.limit:,}",
                    f"{free:,}",
                )

    def _next_use(self, dirs: np.ndarray, shards: np.ndarray) -> np.ndarray:
        """Next read of each of the given cached units, as the node's readers stand (units of
        other datasets: never)."""
        nu = np.full(dirs.size, NEVER, dtype=np.int64)
        uid = np.full(dirs.size, -1, dtype=np.int64)
        for d in self.dirs:
            m = (dirs == d.id) & (shards < len(d.manifest.shards))
            uid[m] = shards[m] + d.base
        ours = uid >= 0
        if ours.any():
            e0, p0, top = self._frame()
            nu[ours] = plan.next_uses(self.plan, uid[ours], e0, p0, top)
        return nu

    # --- the plan -------------------------------------------------------------------------

    def plan(self, epoch: int) -> EpochPlan:
        with self._plan_lock:
            hit = self._plans.get(epoch)
            if hit is not None:
                self._plans.move_to_end(epoch)
                return hit
        p = self.order.plan(epoch, {i: d.base for i, d in self.src_dir.items()})
        with self._plan_lock:
            self._plans[epoch] = p
            if len(self._plans) > _PLANS:
                self._plans.popitem(last=False)
        return p

    # --- reading --------------------------------------------------------------------------

    def local_root(self, i: int) -> str:
        """The directory that holds source ``i``'s cached files."""
        return os.path.join(self.cache_dir, self.src_dir[i].name)

    def attach(self, i: int, holder: ShardHolder) -> None:
        """``holder`` keeps source ``i``'s shards open (see :class:`ShardHolder`)."""
        self._holders[i] = holder

    def advance(self, epoch: int, positions: np.ndarray) -> None:
        """A reader is about to read ``positions`` of ``epoch``: register the position, close
        the shards it is done with, start the downloads it will need next."""
        st = self._proc()
        p = int(positions[0]) if len(positions) else 0
        st.pos = (epoch, p)
        self.registration.register(epoch, p)
        ep = self.plan(epoch)
        self._release_done(ep, p, int(positions.max()) if len(positions) else p)
        if self.fetcher_alive():
            st.pool.drop_queued()  # what this process queued before the fetcher came up
            return  # the fetcher process prefetches for every reader of the node
        e, bound, t = st.next_eval
        now = time.monotonic()
        if e == epoch and p < bound and now - t < 0.05:
            return  # same stretch of the plan, checked moments ago
        st.next_eval = (epoch, self.prefetch(epoch, p), now)

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
        self.registration.leave()

    def _release_done(self, ep: EpochPlan, p: int, q: int) -> None:
        for i, h in self._holders.items():
            shards = np.asarray(h.open_shards(), dtype=np.int64)
            if shards.size:
                done = shards[~ep.overlaps(shards + self.src_dir[i].base, p, q)]
                h.close_shards(done.tolist())

    def _unpin_all(self) -> None:
        """Close every shard this process has open: it is about to wait for room, and its
        pins must not be what keeps the cache full."""
        for h in self._holders.values():
            h.close_shards(h.open_shards())

    def prefetch(self, epoch: int, p: int) -> int:
        """Queue the units read at ``p`` of ``epoch`` and the next ``prefetch_shards``;
        returns the next position at which that set changes."""
        st = self._proc()
        st.pos = (epoch, p)
        ep = self.plan(epoch)
        targets, bound = plan.prefetch_targets(
            ep,
            lambda: self.plan(epoch + 1),
            p,
            self.prefetch_shards,
            self.config.cap_bytes,
            self.unit_bytes,
            self.next_epoch_ahead,
        )
        now = time.monotonic()
        # recorded ready in the index (one read of 16 bytes while it is unchanged) rather
        # than present(): that stats both files of every target, 20-30 units on every call
        # of the fetcher's loop, for a check the reader makes anyway when it pins the unit
        # (a changed file fails it there, and that read's demand fetches the unit again)
        ready = self.units.index.ready_stamps()
        for u, prio in targets:
            if st.retry_after.get(u, 0.0) > now or self._key(u) in ready or st.pool.busy(u):
                continue
            st.pool.submit(u, prio)
        return bound

    def open(self, i: int, shard: int, opener: Callable[[], T]) -> PinnedShard:
        """Source ``i``'s ``shard``, opened by ``opener`` once its unit is in the cache
        (waiting for its download), pinned until it is closed."""
        pin = self._acquire(self.src_dir[i].base + shard)
        try:
            inner = opener()
        except BaseException:
            pin.release()
            raise
        return PinnedShard(inner, pin)

    def _try_pin(self, uid: int) -> Pin | None:
        d, shard = self._unit(uid)
        pin = self.locks.pin(d.name, shard)
        if pin is not None and not self._present(uid):
            pin.release()
            return None
        return pin

    def _acquire(self, uid: int) -> Pin:
        pin = self._try_pin(uid)
        if pin is not None:
            return pin
        st = self._proc()
        t0 = time.monotonic()
        self.slot.block(True)
        self.registration.touch(want=uid)
        # With a fetcher process, let it download (it sees `want`); only if it has not got
        # the unit after grace_s (or is gone) does this process fetch it itself.
        delegate = t0 + self.config.grace_s if self.fetcher_alive() else t0
        d, shard = self._unit(uid)
        try:
            fut: Future[str] | None = None
            status = "queued"
            seen = (-1, -1, "")
            last = t0
            nap = 0.001
            while True:
                # pin first, ask for a fetch only when that fails: a fetch queued once the unit
                # is in runs after this read, and once the unit is evicted (read, next needed
                # an epoch later) downloads it again for nothing
                pin = self._try_pin(uid)
                if pin is not None:
                    st.pool.drop_queued(only=uid)  # asked for just before the download ended
                    if fut is not None and fut.done() and not fut.cancelled() and fut.exception():
                        pin.release()  # the fetch this read waited for failed after its
                        fut.result()  # commit (its event log refused): say so, naming why
                    return pin
                now = time.monotonic()
                own = now >= delegate or not self.fetcher_alive()
                if own and (fut is None or fut.done()):
                    if fut is not None and not fut.cancelled():
                        status = fut.result()  # a failed download raises here, naming the URL
                        if status == "noroom":
                            self._unpin_all()
                        if status in ("done", "present"):
                            fut = None
                            continue  # pin what it brought in before asking again
                    fut = st.pool.submit(uid, self._abs(*st.pos))
                mark = (self.locks.heartbeat(d.name, shard), self.units.index.generation(), status)
                if mark != seen:
                    seen, last = mark, now
                elif now - last > self.config.timeout:
                    self._stalled(uid, status, now - last)
                self.registration.touch()
                if fut is None or status in ("busy", "noroom") or fut.done():
                    # another process has it, or room is awaited: poll, waking at once when
                    # a download in flight (the unit's lock held) finishes
                    self.locks.nap(d.name, shard, nap)
                    nap = min(nap * 2, 0.01 if fut is None else 0.05)
                else:
                    wait([fut], timeout=0.05)  # our own thread downloads it: wake when done
        finally:
            self.registration.touch(want=-1)
            self.slot.block(False)

    def _stalled(self, uid: int, status: str, secs: float) -> None:
        d, shard = self._unit(uid)
        url = join_path(d.url, d.manifest.shards[shard].name)
        if status == "noroom":
            raise RuntimeError(
                f"{url}: no room in the cache for {secs:.0f}s: {self.units.used():,} of "
                f"cache_limit={self.limit:,} bytes are held by shards other readers of this node "
                "have open or need sooner (readers far apart - ranks out of step?); raise "
                "cache_limit or lower CacheConfig(prefetch_shards)"
            )
        raise fetch.RemoteStorageError(
            f"{url}: download made no progress for {secs:.0f}s (CacheConfig.timeout="
            f"{self.config.timeout:g}); the storage is unreachable or stalled - check it, then "
            "resume"
        )

    # --- the node's readers and its fetcher process ------------------------------------------

    def live_readers(self) -> list[tuple[int, int, int]]:
        """(epoch, position, wanted unit or -1) of this dataset's live readers on the node."""
        return live_readers(self.cache_dir, self.ds_id, self.config.timeout)

    def reader_records(self) -> list[tuple[str, int, int, int, tuple[int, int]]]:
        """Those readers' records (:func:`.readers.reader_records`), for the fetcher."""
        return reader_records(self.cache_dir, self.ds_id, self.config.timeout)

    def _frame(self) -> tuple[int, int, int]:
        """(epoch, position) of this dataset's slowest live reader on the node, and the
        latest epoch any of them is in."""
        regs = [(e, p) for e, p, _ in self.live_readers()]
        if not regs:
            st = self._proc()
            regs = [(max(st.pos[0], 0), st.pos[1])]
        e0, p0 = min(regs)
        return e0, p0, max(e for e, _ in regs)

    def _reached(self) -> int:
        """The farthest absolute position this dataset's live readers on the node are at:
        a unit first read there or before is needed now."""
        regs = [(e, p) for e, p, _ in self.live_readers()] or [self._proc().pos]
        return max(self._abs(max(e, 0), p) for e, p in regs)

    def demand(self, want: int, epoch: int, pos: int) -> None:
        """A reader at ``pos`` of ``epoch`` waits for unit ``want``: fetch it first (a unit
        already queued by the prefetch plan moves ahead; one downloading is left to finish)."""
        st = self._proc()
        if 0 <= want < self.unit_bytes.size:
            st.pool.submit(want, self._abs(epoch, pos) - 1)  # ahead of everything

    def leave(self) -> None:
        """This process is done with the cache (a fetcher on its way out): end its downloads
        in flight as an exit does (their temporaries and reservations removed), then remove
        what dead downloads left in units nobody holds (:meth:`UnitStore.sweep`)."""
        st = self._state
        if st is not None and st.pid == os.getpid():
            st.pool.stop(_STOP_S)
        self.units.sweep()

    def fetch_path(self, suffix: str) -> str:
        """``<cache_dir>/.fetch/<dataset><suffix>``: the fetcher's lock, log and doorbell."""
        return os.path.join(self.cache_dir, ".fetch", dir_name(self.ds_id) + suffix)

    def fetch_lock_path(self) -> str:
        return self.fetch_path(".lock")

    def hold_fetch_lock(self) -> bool:
        """Become this node's fetcher of the dataset (held until this process exits)."""
        fd = open_lock_fd(self.fetch_lock_path())
        if try_flock(fd, fcntl.LOCK_EX):
            return True
        close_lock_fd(fd)
        return False

    def fetcher_alive(self) -> bool:
        """Whether a fetcher process serves this dataset on this node (it holds its lock);
        starts one when none does."""
        st = self._proc()
        now = time.monotonic()
        if now < st.fetcher_checked + 0.5:
            return st.fetcher_up
        st.fetcher_checked = now
        try:
            fd = open_lock_fd(self.fetch_lock_path(), os.O_RDONLY)
        except FileNotFoundError:
            st.fetcher_up = False
        else:
            try:
                st.fetcher_up = not try_flock(fd, fcntl.LOCK_SH)
            finally:
                close_lock_fd(fd)
        if not st.fetcher_up and self.config.fetch_process and now > st.fetcher_spawned + 5.0:
            st.fetcher_spawned = now
            fetcher.spawn(self)
        return st.fetcher_up

    # --- bringing a unit in (runs in the pool) --------------------------------------------

    def _fetch(self, uid: int, prio: int) -> str:
        """Bring one unit into the cache if nobody else is and the cache admits it: its
        files found on disk are verified, else downloaded verified - its shard alone when
        its index was kept at its eviction. Returns "present", "busy" (another process has
        it), "noroom" or "done"."""
        st = self._proc()
        d, shard = self._unit(uid)
        fd = self.locks.open(d.name, shard)
        try:
            if not try_flock(fd, fcntl.LOCK_EX):
                st.retry_after[uid] = time.monotonic() + 0.02
                return "busy"
            if self._present(uid):
                return "present"
            files = self.units.files(d.id, shard) or []
            self.units.unlink([(p, 0) for p in self.units.temps(d.id, shard)])  # a dead download's
            key, need = (d.id, shard), int(self.unit_bytes[uid])
            kept = self.units.kept_index(key, files)
            get = files[:1] if kept else files  # what is not on disk verified
            # read-ahead waits for room rather than take a kept index's: that index saves a
            # GET for certain, the read-ahead only maybe a wait (issue 22)
            now = prio <= self._reached()
            if not self.units.reserve(key, need, prio, self._next_use, st.pos[0], now):
                self.units.unlink(get)  # found there but not counted: not kept
                st.retry_after[uid] = time.monotonic() + 0.02
                return "noroom"
            t0 = time.monotonic()
            found = not kept and self.units.complete(files) and self._verify_found(d, shard, files)
            if not found:
                try:
                    self._download(st, fd, d, shard, get)
                except BaseException:
                    self.units.unlink(files)
                    self.units.unreserve(key)
                    raise
            self.units.commit(key, need, files, kept)
            self.events.write(
                "verify" if found else "download",
                dir=d.name,
                shard=shard,
                bytes=need if found else sum(size for _, size in get),
                epoch=st.pos[0],
                for_epoch=(prio + 1) // (self.length + 1),
                secs=round(time.monotonic() - t0, 4),
                **({"kept_index": True} if kept else {}),
            )
            return "done"
        finally:
            close_lock_fd(fd)

    def _verify_found(self, d: _Dir, shard: int, files: Files) -> bool:
        """Files of a unit found on disk (not downloaded by a verified fetch, or changed
        since): they must match the whole-file checksums of dataset.json before any sample
        is read from them (issue 20 item 8). A mismatch is discarded (and downloaded again)."""
        info = d.manifest.shards[shard]
        bad = fetch.check_files(files, (info.checksum, info.index_checksum))
        if bad is None:
            return True
        self.units.unlink(files)
        self.events.write(
            "discard",
            dir=d.name,
            shard=shard,
            file=os.path.basename(bad),
            why="checksum differs from dataset.json",
        )
        return False

    def _download(self, st: _Proc, fd: int, d: _Dir, shard: int, files: Files) -> None:
        """Download ``files``: the unit's shard and index, or its shard alone."""
        info = d.manifest.shards[shard]
        count = len(files)  # 1: the shard alone (its index kept)

        def on_bytes(n: int) -> None:
            if st.pool.stopping:
                raise _Stopped
            os.utime(fd)  # the heartbeat: the lock file's mtime

        fetch.download_unit(
            self._store(d),
            d.url,
            (info.name, info.index)[:count],
            files,
            (info.checksum, info.index_checksum)[:count],
            self.config,
            on_bytes,
        )

    # --- introspection --------------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """(bytes accounted in the cache, units in it: kept index files count in the bytes,
        not as units)."""
        with self.units.index.locked() as (_, rec):
            return int(rec[:, 2].sum()), int((rec[:, 3] != INDEXED).sum())

    def fetch(self, uids: Sequence[int], prio: int = 0) -> list[str]:
        """Download ``uids`` now with the pool (blocking); used by ``data bench``."""
        st = self._proc()
        futs = [st.pool.submit(int(u), prio) for u in uids]
        c = self.config
        return [f.result(timeout=c.timeout * (c.retries + 2)) for f in futs]


class _Stopped(BaseException):
    """Raised inside a download when its process shuts down (not retried, not an error)."""


def check_cache_config(roots: Sequence[str], config: CacheConfig) -> None:
    """Refuse a remote source without a cache directory before anything is read."""
    remote = [r for r in roots if is_remote(r)]
    if remote and config.cache_dir is None:
        raise ValueError(
            f"{remote[0]}: a remote dataset is read through a local cache; pass cache_dir= "
            "(local disk, shared by the ranks of a node) and cache_limit= in its CacheConfig: "
            "StreamingDataset(url, cache=CacheConfig(cache_dir='/nvme/cache', "
            "cache_limit='200GB')); or stage it first with `unbroken data stage URL DIR`"
        )
    if not remote and (config.cache_dir is not None or config.cache_limit is not None):
        log.info("cache_dir/cache_limit ignored: every source is a local directory")


def fit_cache(
    order_for: Callable[[int | None], DatasetOrder],
    sources: Sequence[RemoteSource],
    dataset: DatasetConfig,
    config: CacheConfig,
) -> tuple[int | None, CacheConfig]:
    """The shuffle window to use instead of the default (None: keep it) and the cache
    config with the read-ahead to use, when ``config.cache_limit`` cannot hold the defaults
    (:func:`.plan.fit_to_limit`, issue 22 item 3); an explicit ``shuffle_window`` or
    ``prefetch_shards`` is kept."""
    limit = config.limit_bytes
    if not sources or limit is None or not dataset.shuffle:
        return None, config
    units: dict[int, np.ndarray] = {}
    manifests: dict[str, int] = {}
    for s in sources:
        units[s.index] = np.array(
            [x.bytes + x.index_bytes for x in s.manifest.shards], dtype=np.int64
        )
        manifests[s.manifest.fingerprint] = len(s.manifest.dumps())
    window, prefetch = plan.fit_to_limit(
        order_for,
        units,
        limit,
        config.cap_bytes,
        sum(manifests.values()),
        window=dataset.shuffle_window,
        prefetch=config.prefetch_shards,
    )
    if prefetch is not None:
        config = dataclasses.replace(config, prefetch_shards=prefetch)
    return window, config


def open_cache(
    order: DatasetOrder, sources: Sequence[RemoteSource], config: CacheConfig
) -> RemoteCache | None:
    """A :class:`RemoteCache` for the remote ``sources``; None when there are none."""
    if not sources:
        return None
    cache = RemoteCache(order, sources, config)
    cache.fetcher_alive()  # starts the fetcher now: it is up when the first reader registers
    return cache
