"""Worker -> main transport of collated batches through reusable shared memory.

torch's DataLoader sends each batch from a worker to the main process as a pickle written
through a pipe: for a list of 256 x 4 KB byte strings that is ~1 MB pushed through a 64 KB pipe
buffer in many writes and wake-ups, copied into and out of the kernel, reassembled in a
``BytesIO`` and then unpickled - on a 2-core box most of the time of a fast loader.

Here the worker pickles the batch (with the same ``ForkingPickler`` and protocol torch uses, so
tensors inside still travel by torch's own shared-memory hand-off and every object comes back
exactly as the stock path would return it) straight into a slot of a ring of shared-memory
slots (an anonymous ``memfd``), and the worker queue carries only a small :class:`Ticket`.
The main process unpickles from the slot and then marks it free in the ring's header.

Where the memory comes from: the main process creates one empty ``memfd`` per worker before
the workers start (:func:`worker_fds`); a forked worker inherits it and sizes it at its first
batch, so nothing has to be handed over. A worker that did not inherit it (spawn, forkserver)
makes its own ``memfd`` and sends it once, with the first ticket that uses it
(``multiprocessing``'s fd passing, which costs a few ms of round trips with the worker).

Ring layout (one ``memfd`` per ring; when a batch does not fit, an inherited ring is enlarged
in place once every ticket in it has been consumed, an own ring is replaced by a larger one)::

    [0:8)     int64 little-endian: number of tickets the main process has consumed
    [64:...)  ``slots`` slots of ``slot_bytes`` each; ticket ``k`` uses slot ``k % slots``

The worker writes ticket ``k`` only when ticket ``k - slots`` has been consumed; otherwise (and
for batches too big for the ring's size cap, on systems without ``memfd``, or when the pickle
cannot be written) it hands the batch to torch's stock path unchanged, so the transport never
blocks and never changes what the caller receives.
"""

from __future__ import annotations

import io
import logging
import mmap
import os
import pickle
import weakref
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

__all__ = ["RingReceiver", "RingSender", "Ticket", "transport_available", "worker_fds"]

log = logging.getLogger(__name__)

_HEADER = 64  # consumed counter, padded to a cache line so slot 0 does not share it
_MIN_SLOT = 1 << 20
_FD_TYPES: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
# Largest ring per worker; a batch whose slot would exceed its share takes the stock path.
_MAX_RING = 512 << 20


def transport_available() -> bool:
    """Shared-memory rings need ``os.memfd_create`` (Linux)."""
    return hasattr(os, "memfd_create")


def worker_fds(n: int) -> list[tuple[int, int, int]]:
    """One empty ``memfd`` per worker, made in the main process before the workers start:
    ``(fd, st_dev, st_ino)`` so that a worker can tell it really inherited that file."""
    out = []
    for i in range(n):
        fd = os.memfd_create(f"unbroken-ring-w{i}", os.MFD_CLOEXEC)
        st = os.fstat(fd)
        out.append((fd, st.st_dev, st.st_ino))
    return out


def _inherited(spec: tuple[int, int, int] | None) -> int | None:
    if spec is None:
        return None
    fd, dev, ino = spec
    try:
        st = os.fstat(fd)
    except OSError:
        return None  # not inherited (spawn / forkserver)
    return fd if (st.st_dev, st.st_ino) == (dev, ino) else None


class Ticket:
    """What crosses the worker queue instead of a batch: where its pickle lies."""

    __slots__ = ("fd", "nbytes", "offset", "ring", "ring_bytes", "seq")

    def __init__(
        self, ring: tuple[int, int], seq: int, offset: int, nbytes: int, ring_bytes: int, fd: Any
    ) -> None:
        # (worker pid, ring number) for a worker's own ring, (0, worker id) for an inherited one
        self.ring = ring
        self.seq = seq
        self.offset = offset
        self.nbytes = nbytes
        self.ring_bytes = ring_bytes
        self.fd = fd  # a DupFd on the first ticket of a ring, else None

    def __reduce__(self) -> tuple[Any, ...]:
        return Ticket, (self.ring, self.seq, self.offset, self.nbytes, self.ring_bytes, self.fd)

    def __repr__(self) -> str:
        return f"Ticket(ring={self.ring}, seq={self.seq}, nbytes={self.nbytes})"


class _Full(Exception):
    """The pickle does not fit the slot."""


class _HandsOverFds(Exception):
    """The batch holds an object that ``ForkingPickler`` sends as a file descriptor."""


class _Pickler(ForkingPickler):
    """``ForkingPickler`` that refuses objects with a fd-passing reduction (torch tensors and
    storages, connections, sockets): those must be unpickled while the worker still lives,
    which torch's queue does on arrival but a ticket, unpacked later, cannot promise."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _FD_TYPES:
            raise _HandsOverFds
        return NotImplemented


class _SlotWriter:
    """File object for ``Pickler``: writes into ``mm[pos:end]``, raises ``_Full`` past it."""

    __slots__ = ("end", "mm", "pos")

    def __init__(self, mm: mmap.mmap, pos: int, end: int) -> None:
        self.mm, self.pos, self.end = mm, pos, end

    def write(self, b: Any) -> int:
        n = len(b) if isinstance(b, bytes) else memoryview(b).nbytes
        pos = self.pos
        if pos + n > self.end:
            raise _Full
        self.mm[pos : pos + n] = b
        self.pos = pos + n
        return n


class _Ring:
    def __init__(
        self, key: tuple[int, int], slots: int, slot_bytes: int, fd: int | None = None
    ) -> None:
        self.key = key
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.size = _HEADER + slots * slot_bytes
        self.inherited = fd is not None
        self.fd = (
            os.memfd_create(f"unbroken-ring-{key[0]}-{key[1]}", os.MFD_CLOEXEC)
            if fd is None
            else fd
        )
        try:
            if os.fstat(self.fd).st_size < self.size:
                os.ftruncate(self.fd, self.size)
            self.mm = mmap.mmap(self.fd, self.size)
        except BaseException:
            if not self.inherited:
                os.close(self.fd)
            raise
        self.seq = 0
        self.sent_fd = self.inherited  # the main process holds an inherited fd already

    def enlarge(self, slot_bytes: int) -> None:
        """Inherited rings only, with every ticket consumed: same file, larger slots."""
        size = _HEADER + self.slots * slot_bytes
        os.ftruncate(self.fd, size)
        mm = mmap.mmap(self.fd, size)
        self.mm.close()
        self.mm, self.slot_bytes, self.size = mm, slot_bytes, size

    def consumed(self) -> int:
        return int.from_bytes(self.mm[0:8], "little", signed=True)

    def close(self) -> None:
        self.mm.close()
        if not self.inherited:
            os.close(self.fd)


class RingSender:
    """Worker side: turns batches into tickets (or leaves them to the stock path).

    ``slots`` must exceed the batches a worker can have in flight (sent but not yet consumed by
    the main process): ``prefetch_factor * num_workers + 2`` for a DataLoader.
    """

    def __init__(
        self,
        slots: int,
        max_ring_bytes: int = _MAX_RING,
        *,
        worker_id: int = 0,
        fd_spec: tuple[int, int, int] | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be >= 1")
        self.slots = slots
        self.max_ring_bytes = max_ring_bytes
        self._ring: _Ring | None = None
        self._rings = 0
        self._pid = os.getpid()
        self._wid = worker_id
        self._fd = _inherited(fd_spec)
        self._disabled = not transport_available()

    def pack(self, batch: Any) -> Any:
        """A :class:`Ticket` for ``batch``, or ``batch`` itself for the stock path."""
        if self._disabled:
            return batch
        ring = self._ring
        try:
            if ring is not None:
                k = ring.seq
                if k - ring.consumed() >= ring.slots:
                    return batch  # main has not freed the slot yet: never wait
                off = _HEADER + (k % ring.slots) * ring.slot_bytes
                w = _SlotWriter(ring.mm, off, off + ring.slot_bytes)
                try:
                    _Pickler(w).dump(batch)
                except _Full:
                    pass  # grow below
                else:
                    return self._ticket(ring, off, w.pos - off)
            buf = io.BytesIO()
            _Pickler(buf).dump(batch)
        except _HandsOverFds:
            # Such batches (tensors, ...) keep torch's path; a stream's batches are alike.
            self._disabled = True
            return batch
        data = buf.getbuffer()
        ring = self._grow(len(data))
        if ring is None:
            return batch
        off = _HEADER + (ring.seq % ring.slots) * ring.slot_bytes
        ring.mm[off : off + len(data)] = data
        return self._ticket(ring, off, len(data))

    def _ticket(self, ring: _Ring, off: int, nbytes: int) -> Ticket:
        fd = None
        if not ring.sent_fd:
            fd = DupFd(ring.fd)
            ring.sent_fd = True
        t = Ticket(ring.key, ring.seq, off, nbytes, ring.size, fd)
        ring.seq += 1
        return t

    def _grow(self, nbytes: int) -> _Ring | None:
        slot = _MIN_SLOT
        while slot < nbytes + (nbytes >> 2):
            slot <<= 1
        if _HEADER + self.slots * slot > self.max_ring_bytes:
            return None
        old = self._ring
        try:
            if self._fd is not None:
                if old is not None:
                    if old.consumed() != old.seq:
                        return None  # tickets still in flight in the old layout: retry later
                    old.enlarge(slot)
                    return old
                new = _Ring((0, self._wid), self.slots, slot, self._fd)
            else:
                self._rings += 1
                new = _Ring((self._pid, self._rings), self.slots, slot)
        except OSError as e:
            log.warning(
                "shared-memory batch transport off in worker %d (%s); batches take the pipe",
                self._pid,
                e,
            )
            self._disabled = True
            return None
        # The old ring's memory lives on in the main process until it maps the new ring.
        if old is not None:
            old.close()
        self._ring = new
        return new

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None


class _Mapped:
    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.consumed = 0


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class RingReceiver:
    """Main side: tickets back to batches; anything else passes through unchanged.

    ``fds``: the :func:`worker_fds` the workers were started with; the receiver closes them.
    """

    def __init__(self, fds: list[tuple[int, int, int]] | None = None) -> None:
        self._rings: dict[tuple[int, int], _Mapped] = {}
        self._latest: dict[int, tuple[int, int]] = {}  # worker pid -> its current ring
        self._fds = [f for f, _, _ in fds or ()]
        # backstop for a loader dropped without finishing its iteration (persistent workers)
        self._finalizer = weakref.finalize(self, _close_fds, list(self._fds))

    def unpack(self, item: Any) -> Any:
        if not isinstance(item, Ticket):
            return item
        ring = self._rings.get(item.ring)
        if ring is None or len(ring.mm) < item.ring_bytes:
            ring = self._map(item, ring)
        with memoryview(ring.mm) as view, view[item.offset : item.offset + item.nbytes] as src:
            batch = pickle.loads(src)
        ring.consumed = item.seq + 1
        ring.mm[0:8] = ring.consumed.to_bytes(8, "little", signed=True)
        return batch

    def _map(self, t: Ticket, old: _Mapped | None) -> _Mapped:
        if t.ring[0] == 0:
            # an inherited ring, new or enlarged (only once all its tickets were consumed)
            wid = t.ring[1]
            if not 0 <= wid < len(self._fds):
                raise RuntimeError(f"batch transport: {t!r} names worker {wid}, not started here")
            mapped = _Mapped(mmap.mmap(self._fds[wid], t.ring_bytes))
            if old is not None:
                mapped.consumed = old.consumed
                old.mm.close()
            self._rings[t.ring] = mapped
            return mapped
        if t.fd is None:
            raise RuntimeError(
                f"batch transport: {t!r} refers to a ring this process never received (its "
                "first ticket was lost); pass shm_transport=False to StatefulLoader and report "
                "this as a bug"
            )
        fd = t.fd.detach()
        try:
            mm = mmap.mmap(fd, t.ring_bytes)
        finally:
            os.close(fd)
        ring = self._rings[t.ring] = _Mapped(mm)
        pid = t.ring[0]
        prev = self._latest.get(pid)
        self._latest[pid] = t.ring
        if prev is not None:
            # a worker's tickets arrive in order: nothing refers to its previous ring any more
            self._rings.pop(prev).mm.close()
        return ring

    def close(self) -> None:
        for r in self._rings.values():
            r.mm.close()
        self._rings.clear()
        self._latest.clear()
        self._finalizer()
        self._fds = []
