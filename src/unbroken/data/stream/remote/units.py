"""The units of a node cache on disk: which files make each, whether a unit is ready, and how
the budget admits one (evicting others), commits it, or gives its room back.

A unit is one shard and its index, ``<cache_dir>/<dir>/<name>`` where ``<dir>`` is the first
16 hex digits of its dataset's fingerprint. Evicting a unit deletes its shard and keeps its
index file (a few KB against MB: state "indexed", still counted), so that fetching the unit
again is one GET; kept indexes go only when the shards alone cannot make the room a read
needs now. Every change is a read-modify-write of the shared index (:class:`~unbroken.data.stream.remote.index.SharedIndex`) made while the unit's lock is
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
    INDEXED,
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
Victims = dict[int, tuple[int, int, int]]
"""{record row: (descriptor holding the unit's lock, stamp of the index file it keeps or 0
for none, that index's bytes)} of the units an eviction takes."""


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

    def kept_index(self, key: tuple[int, int], files: Files) -> int:
        """The stamp of the unit's index file kept on disk when its shard was evicted, while
        it is still the file that was verified; else 0. One changed since (written,
        replaced, truncated) is deleted: it is downloaded again with its shard. Called with
        the unit's lock held, so no eviction takes the record meanwhile."""
        with self.index.locked() as (_, rec):
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1]) & (rec[:, 3] == INDEXED)
            want = int(rec[mine, 4][0]) if mine.any() else 0
        if want == 0 or stamp(files[1:]) == want:
            return want
        self.unlink(files[1:])  # its record still counts it until the reservation replaces it
        self.events.write(
            "discard",
            dir=dir_name(key[0]),
            shard=key[1],
            file=os.path.basename(files[1][0]),
            why="changed since it was verified",
        )
        return 0

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
        self,
        key: tuple[int, int],
        need: int,
        prio: int,
        next_use: NextUse,
        epoch: int = -1,
        indexes: bool = True,
    ) -> bool:
        """Hold ``need`` bytes for unit ``key``, evicting (:meth:`_choose`) what is needed
        later than ``prio`` if that makes room (kept indexes too when ``indexes``: a reader
        needs the unit now); False (nothing evicted) if it cannot. What the unit's record
        counts already is part of its room: all of it for a unit found on disk or a ready
        one whose files changed, its index's bytes for a kept index; only the rest is made."""
        with self.index.locked() as (gen, rec):
            rec, changed = self._clean_reserved(rec, key)
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1])
            more = need - int(rec[mine, 2].sum())
            victims: Victims | None = {}
            if self.limit is not None and more > 0:
                short = self.used(rec, extra=0 if mine.any() else 1) + more - self.limit
                if short > 0:
                    victims = self._choose(rec, prio, short, next_use, mine, indexes)
            if victims is None:
                if changed:
                    self.index.write(gen + 1, rec)
                return False
            rec = self._evict(rec, victims, epoch)
            mine = (rec[:, 0] == key[0]) & (rec[:, 1] == key[1])
            held = np.array([[*key, need, RESERVED, 0]], dtype=np.int64)
            self.index.write(gen + 1, np.concatenate([rec[~mine], held]))
            return True

    def commit(self, key: tuple[int, int], need: int, files: Files, kept: int = 0) -> None:
        """The unit is verified: ready, with the stamp of the files that were verified.
        ``kept``: the stamp of its kept index (:meth:`kept_index`), only its shard
        downloaded; an index changed since that check leaves the unit found (checked
        against dataset.json before it is read)."""
        both = stamp(files)  # before the index alone: a change in between shows in that one
        ok = kept == 0 or stamp(files[1:]) == kept
        row = np.array([[*key, need, READY if ok else FOUND, both if ok else 0]], dtype=np.int64)
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
        self,
        rec: np.ndarray,
        prio: int,
        short: int,
        next_use: NextUse,
        skip: np.ndarray | None = None,
        indexes: bool = True,
    ) -> Victims | None:
        """Units not open anywhere (nor ``skip``), farthest next use first, until ``short``
        bytes are free: first the shards of ready or found units needed later than
        ``prio`` - a ready unit keeps its index, a found one's goes with it (never verified)
        - then, only if that is not enough and ``indexes``, kept index files, at any next
        use: read by nobody, a kept index then never takes room a cache without it would
        have given, so the least limit (:func:`.plan.min_limit`) is what it was. Returns the
        victims, their locks held, or None (none held)."""
        cand = rec[:, 3] != RESERVED
        if skip is not None:
            cand &= ~skip
        rows = np.flatnonzero(cand)
        if rows.size == 0:
            return None
        nu = next_use(rec[rows, 0], rec[rows, 1])
        order = [(int(rows[j]), int(nu[j])) for j in np.argsort(-nu, kind="stable").tolist()]
        held: Victims = {}
        freed = 0
        for row, when in order:
            if when <= prio:
                break  # everything left is needed no later than the unit asking for room
            if rec[row, 3] == INDEXED or (fd := self._lock_unit(rec[row])) < 0:
                continue
            keep, index_bytes = self._index_to_keep(rec[row])
            held[row] = (fd, keep, index_bytes)
            freed += int(rec[row, 2]) - (index_bytes if keep else 0)
            if freed >= short:
                return held
        for row, _ in order if indexes else ():
            if row in held:
                fd, keep, index_bytes = held[row]
                if not keep:
                    continue
                held[row] = (fd, 0, index_bytes)
                freed += index_bytes
            elif rec[row, 3] == INDEXED and (fd := self._lock_unit(rec[row])) >= 0:
                held[row] = (fd, 0, int(rec[row, 2]))
                freed += int(rec[row, 2])
            else:
                continue
            if freed >= short:
                return held
        for fd, _, _ in held.values():
            close_lock_fd(fd)
        return None

    def _lock_unit(self, row: np.ndarray) -> int:
        """The unit's lock taken (a descriptor holding LOCK_EX), or -1: open by a reader, or
        being fetched or evicted."""
        fd = self.locks.open(dir_name(int(row[0])), int(row[1]))
        if try_flock(fd, fcntl.LOCK_EX):
            return fd
        close_lock_fd(fd)
        return -1

    def _index_to_keep(self, row: np.ndarray) -> tuple[int, int]:
        """(stamp, bytes) of the index file a ready unit keeps when its shard is evicted;
        (0, bytes) when it keeps none: found (never verified), or its files changed since
        they were verified."""
        files = self.files(int(row[0]), int(row[1]))
        if files is None:
            return 0, 0
        index_bytes = files[1][1]
        if row[3] != READY:
            return 0, index_bytes
        # the index alone first: a change before the two are stamped shows in those
        kept = stamp(files[1:])
        return (kept if kept and stamp(files) == row[4] else 0), index_bytes

    def _evict(self, rec: np.ndarray, victims: Victims, epoch: int) -> np.ndarray:
        """Delete the victims' shards, and their indexes unless kept (their locks held), and
        drop or turn their records into kept indexes (``epoch``: where the reader that asked
        for room is, for the event log). The kept indexes one call drops are one event per
        dataset (a shard's room can take dozens; the log is bounded)."""
        rec = rec.copy()
        drop = np.zeros(rec.shape[0], dtype=bool)
        dropped: dict[int, list[int]] = {}  # dataset id -> rows of kept indexes dropped
        for row, (vfd, keep, index_bytes) in victims.items():
            did, shard = int(rec[row, 0]), int(rec[row, 1])
            files = self.files(did, shard) or []
            try:
                self.unlink(files[:1] if keep else files)
            finally:
                close_lock_fd(vfd)
            if rec[row, 3] == INDEXED:
                dropped.setdefault(did, []).append(row)
            else:
                self.events.write(
                    "evict",
                    dir=dir_name(did),
                    shard=shard,
                    bytes=int(rec[row, 2]) - (index_bytes if keep else 0),
                    epoch=epoch,
                    **({"kept_index": True} if keep else {}),
                )
            if keep:
                rec[row, 2:] = (index_bytes, INDEXED, keep)
            else:
                drop[row] = True
        for did, rows in dropped.items():
            self.events.write(
                "evict_index",
                dir=dir_name(did),
                shards=[int(rec[r, 1]) for r in rows],
                bytes=int(rec[rows, 2].sum()),
                epoch=epoch,
            )
        return rec[~drop]

    # --- what a dead process left --------------------------------------------------------

    def _rebuild(self) -> np.ndarray:
        """Records for the complete units found on disk (found: verified when first used);
        partial files of units nobody holds are deleted, an index file kept alone too (its
        record, which vouched for it, is lost; this runs under the node's lock, which
        checking each one against dataset.json here would hold for as long; and an index is
        one GET to fetch again)."""
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
        is found (verified when first used), anything partial is deleted - also the index a
        unit had kept when its shard's download began (a reservation vouches for no file)."""
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
