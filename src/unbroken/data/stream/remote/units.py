"""The units of a node cache on disk: which files make each, whether a unit is ready, and how
the budget admits one (evicting others), commits it, or gives its room back.

A unit is one shard and its index, ``<cache_dir>/<dir>/<name>`` where ``<dir>`` is the first
16 hex digits of its dataset's fingerprint. Every change is a read-modify-write of the shared
index (:class:`~unbroken.data.stream.remote.index.SharedIndex`) made while the unit's lock is
held exclusively; what a dead process left (a reservation, partial files, temporaries) is
cleaned up by the next one that finds its lock free: one reserving room, or one opening the
cache or leaving it as a fetcher (:meth:`UnitStore.sweep`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from unbroken.common.fs import close_lock_fd, is_temp_name
from unbroken.data.manifest import DatasetManifest
from unbroken.data.stream.remote.events import EventLog
from unbroken.data.stream.remote.index import (
    FOUND,
    READY,
    RESERVED,
    SharedIndex,
    dir_id,
    dir_name,
    load_manifest,
    stamp,
)
from unbroken.data.stream.remote.locks import UnitLocks, try_flock
from unbroken.data.stream.remote.plan import bookkeeping_bytes

__all__ = ["Files", "NextUse", "UnitStore"]

Files = list[tuple[str, int]]
"""(local path, size dataset.json records) of a unit's shard and index."""
NextUse = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(dataset ids, shards) of cached units -> the absolute position of each one's next read."""


class UnitStore:
    """The units of ``cache_dir`` (see the module docstring). ``manifests`` are the datasets
    this process reads ({dataset id: manifest}); others sharing the directory are known by
    the manifest copies there. ``limit``: bytes, or None (unbounded)."""

    def __init__(
        self,
        cache_dir: str,
        manifests: dict[int, DatasetManifest],
        limit: int | None,
        timeout: float,
        locks: UnitLocks,
        events: EventLog,
    ) -> None:
        self.cache_dir = cache_dir
        self.manifests = manifests
        self.limit = limit
        self.locks = locks
        self.events = events
        self.index = SharedIndex(cache_dir, timeout, self._rebuild)
        self._foreign: dict[int, DatasetManifest | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_foreign": {}}

    # --- files ----------------------------------------------------------------------------

    def files(self, did: int, shard: int) -> Files | None:
        """A unit's files; None for a unit of no dataset known here."""
        m = self.manifests.get(did)
        if m is None:
            if did not in self._foreign:
                try:
                    self._foreign[did] = load_manifest(os.path.join(self.cache_dir, dir_name(did)))
                except (OSError, ValueError):
                    self._foreign[did] = None
            m = self._foreign[did]
        if m is None or not 0 <= shard < len(m.shards):
            return None
        s = m.shards[shard]
        local = os.path.join(self.cache_dir, dir_name(did))
        return [
            (os.path.join(local, s.name), s.bytes),
            (os.path.join(local, s.index), s.index_bytes),
        ]

    @staticmethod
    def complete(files: Files) -> bool:
        """Every file there, a regular file of its recorded size (not yet verified)."""
        return bool(files) and stamp(files) != 0

    @staticmethod
    def unlink(files: Files) -> None:
        for path, _ in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def present(self, did: int, shard: int) -> bool:
        """The unit is ready to read: verified when it entered the cache, and its files are
        the ones verified (their stamp unchanged)."""
        files = self.files(did, shard)
        if files is None:
            return False
        want = self.index.ready_stamps().get((did, shard))
        return want is not None and want == stamp(files)

    def temps(self, did: int, shard: int) -> list[str]:
        """Temporary files of a download of the unit (in flight, or left by a dead process)."""
        files = self.files(did, shard) or []
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

    # --- the budget -------------------------------------------------------------------------

    def used(self, rec: np.ndarray | None = None, extra: int = 0) -> int:
        """Bytes the cache holds: its units (``rec``: the index records, read under the lock
        when not given) and its own files, the index at ``extra`` more records."""
        if rec is None:
            with self.index.locked() as (_, rec):
                return self.used(rec, extra)
        own = bookkeeping_bytes(self.cache_dir, rec.shape[0] + extra, self.events.size())
        return int(rec[:, 2].sum()) + own

    def reserve(
        self, key: tuple[int, int], need: int, prio: int, next_use: NextUse, epoch: int = -1
    ) -> bool:
        """Hold ``need`` bytes for unit ``key``, evicting units needed later than ``prio``
        (farthest first) if that makes room; False (nothing evicted) if it cannot. A unit
        already counted (found on disk, or a ready record whose files changed) keeps its
        room."""
        with self.index.locked() as (gen, rec):
            rec, changed = self._clean_reserved(rec, key)
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1])
            held = np.array([[*key, need, RESERVED, 0]], dtype=np.int64)
            if mine.any():
                self.index.write(gen + 1, np.concatenate([rec[~mine], held]))
                return True
            victims: list[tuple[int, int]] | None = []  # (record row, locked fd)
            if self.limit is not None:
                short = self.used(rec, extra=1) + need - self.limit
                if short > 0:
                    victims = self._choose(rec, prio, short, next_use)
            if victims is None:
                if changed:
                    self.index.write(gen + 1, rec)
                return False
            rec = self._evict(rec, victims, epoch)
            self.index.write(gen + 1, np.concatenate([rec, held]))
            return True

    def commit(self, key: tuple[int, int], need: int, files: Files) -> None:
        """The unit is verified: ready, with the stamp of the files that were verified."""
        row = np.array([[*key, need, READY, stamp(files)]], dtype=np.int64)
        with self.index.locked() as (gen, rec):
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1])
            # (no record: the index was rebuilt while this download ran)
            self.index.write(gen + 1, np.concatenate([rec[~mine], row]))

    def unreserve(self, key: tuple[int, int]) -> None:
        with self.index.locked() as (gen, rec):
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1])
            self.index.write(gen + 1, rec[~mine])

    def make_room(self, next_use: NextUse) -> None:
        """Evict what is needed last until the cache is within its limit (after this
        dataset's manifest copy was written into a full cache)."""
        if self.limit is None:
            return
        with self.index.locked() as (gen, rec):
            short = self.used(rec) - self.limit
            victims = self._choose(rec, -1, short, next_use) if short > 0 else None
            if victims:
                self.index.write(gen + 1, self._evict(rec, victims, -1))

    def _choose(
        self, rec: np.ndarray, prio: int, short: int, next_use: NextUse
    ) -> list[tuple[int, int]] | None:
        """Ready (or found) units, not open anywhere, needed later than ``prio``: the
        farthest first until ``short`` bytes are free. Returns (row, fd holding LOCK_EX) or
        None."""
        ready = np.flatnonzero(rec[:, 3] != RESERVED)
        if ready.size == 0:
            return None
        nu = next_use(rec[ready, 0], rec[ready, 1])
        held: list[tuple[int, int]] = []
        freed = 0
        for j in np.argsort(-nu, kind="stable").tolist():
            if nu[j] <= prio:
                break  # everything left is needed no later than the unit asking for room
            row = int(ready[j])
            fd = self.locks.open(dir_name(int(rec[row, 0])), int(rec[row, 1]))
            if not try_flock(fd, fcntl.LOCK_EX):
                close_lock_fd(fd)  # open by a reader (or being evicted): not a candidate
                continue
            held.append((row, fd))
            freed += int(rec[row, 2])
            if freed >= short:
                return held
        for _, fd in held:
            close_lock_fd(fd)
        return None

    def _evict(self, rec: np.ndarray, victims: list[tuple[int, int]], epoch: int) -> np.ndarray:
        """Delete the victims' files (their locks held) and drop their records (``epoch``:
        where the reader that asked for room is, for the event log)."""
        drop = np.zeros(rec.shape[0], dtype=bool)
        for row, vfd in victims:
            did, shard = int(rec[row, 0]), int(rec[row, 1])
            try:
                self.unlink(self.files(did, shard) or [])
            finally:
                close_lock_fd(vfd)
            drop[row] = True
            self.events.write(
                "evict", dir=dir_name(did), shard=shard, bytes=int(rec[row, 2]), epoch=epoch
            )
        return rec[~drop]

    # --- what a dead process left --------------------------------------------------------

    def _rebuild(self) -> np.ndarray:
        """Records for the complete units found on disk (found: verified when first used);
        partial files of units nobody holds are deleted."""
        rows = []
        for name in sorted(os.listdir(self.cache_dir)):
            local = os.path.join(self.cache_dir, name)
            if len(name) != 16 or not os.path.isdir(local):
                continue
            try:
                did = dir_id(name)
                m = load_manifest(local)
            except (OSError, ValueError):
                continue
            names = _unit_of_name(m)
            complete = set()
            for k, s in enumerate(m.shards):
                if self.complete(self.files(did, k) or []):
                    rows.append((did, k, s.bytes + s.index_bytes, FOUND, 0))
                    complete.add(k)
            for f in os.listdir(local):
                base = _published_name(f)
                unit = names.get(base)
                if unit is None or (f == base and unit in complete):
                    continue
                self._discard_if_free(did, unit, [os.path.join(local, f)])
        return np.array(rows, dtype=np.int64).reshape(-1, 5)

    def _discard_if_free(self, did: int, shard: int, paths: list[str]) -> bool:
        fd = self.locks.open(dir_name(did), shard)
        try:
            if not try_flock(fd, fcntl.LOCK_EX):
                return False
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
                    self.events.write(
                        "discard", dir=dir_name(did), shard=shard, file=os.path.basename(p)
                    )
            return True
        finally:
            close_lock_fd(fd)

    def sweep(self) -> None:
        """Remove what dead downloads left, wherever no live process holds the unit: their
        reservations (:meth:`_clean_reserved`) and every temporary of a unit of this
        process's datasets, whether or not a record names it. Run when a cache is opened and
        when a fetcher exits: a reservation is otherwise cleaned only by the next
        :meth:`reserve` of another unit, a temporary without one only by the next download
        of its unit, and neither may come before the run ends (issue 22: a fetcher ended
        with its parent left ``.tmp-shard-000006.tar.idx.*`` after the last download of the
        run)."""
        with self.index.locked() as (gen, rec):
            rec, changed = self._clean_reserved(rec, None)
            if changed:
                self.index.write(gen + 1, rec)
        for did, m in self.manifests.items():
            local = os.path.join(self.cache_dir, dir_name(did))
            try:
                names = os.listdir(local)
            except FileNotFoundError:
                continue
            units = _unit_of_name(m)
            found: dict[int, list[str]] = {}
            for f in names:
                unit = units.get(_published_name(f)) if is_temp_name(f) else None
                if unit is not None:
                    found.setdefault(unit, []).append(os.path.join(local, f))
            for unit, paths in sorted(found.items()):
                self._discard_if_free(did, unit, paths)

    def _clean_reserved(
        self, rec: np.ndarray, skip: tuple[int, int] | None
    ) -> tuple[np.ndarray, bool]:
        """Reservations whose downloader died (its unit lock is free): a unit it completed
        is found (verified when first used), anything partial is deleted."""
        changed = False
        keep = np.ones(rec.shape[0], dtype=bool)
        for k in np.flatnonzero(rec[:, 3] == RESERVED).tolist():
            did, shard = int(rec[k, 0]), int(rec[k, 1])
            if (did, shard) == skip:
                continue
            fd = self.locks.open(dir_name(did), shard)
            try:
                if not try_flock(fd, fcntl.LOCK_EX):
                    continue  # still downloading
                files = self.files(did, shard) or []
                # its temporaries whether or not the unit is complete: none is part of it
                self.unlink([(p, 0) for p in self.temps(did, shard)])
                if self.complete(files):
                    rec[k, 3], rec[k, 4] = FOUND, 0
                else:
                    self.unlink(files)
                    keep[k] = False
                    self.events.write(
                        "discard", dir=dir_name(did), shard=shard, file="partial download"
                    )
                changed = True
            finally:
                close_lock_fd(fd)
        return rec[keep], changed


def _unit_of_name(m: DatasetManifest) -> dict[str, int]:
    """{file name: unit} of a dataset's shards and indexes."""
    out = {}
    for k, s in enumerate(m.shards):
        out[s.name] = out[s.index] = k
    return out


def _published_name(name: str) -> str:
    """The name a temporary (``.tmp-<name>.<suffix>``, :func:`~unbroken.common.fs.temp_sibling`)
    is renamed to; any other name as it is."""
    return name[len(".tmp-") :].rsplit(".", 1)[0] if is_temp_name(name) else name
