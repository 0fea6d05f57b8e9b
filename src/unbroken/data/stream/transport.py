"""Worker -> main transport of collated batches through reusable shared memory.

Each DataLoader worker owns a *ring*: one ``memfd`` mapped by both processes, cut into
slots. The worker collates straight into a free slot (:meth:`RingSender.collate`),
pickles the batch there with tensors as references to their bytes, and sends a small
:class:`Ticket`; the main process (:class:`RingReceiver`) wraps the bytes as tensors
without a copy. A slot is recycled only once the last tensor viewing it is gone (and, with
``pin=True``, once the CUDA copies issued from it completed).

What a caller must know: the transport never blocks and never changes what the caller
receives. A batch that cannot take a slot (every slot held, too large, an object that
crosses as a file descriptor, no ``memfd``) takes torch's stock path unchanged, and a
small tensor-free batch takes the pipe. Memory is committed only for slots written, at
most ``_MAX_SLOTS`` per worker.

Why (torch's per-storage file-descriptor round trips cost ten times the decode), the
ring's layout and the slot life cycle: ARCHITECTURE.md, "Design notes" > data > the
transport.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from functools import partial
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate as _collate
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from unbroken.data.feed.prefetch import map_tensors

__all__ = ["RingReceiver", "RingSender", "Ticket", "transport_available", "worker_fds"]

log = logging.getLogger(__name__)

_HEADER = 4096
_DONE = 64  # offset of the released-sequence table
_MAX_SLOTS = 64
_ALIGN = 64  # tensor bytes: any dtype's alignment, and a cache line
_GRAIN = 64 << 10  # slot sizes are multiples of this
# Address space per worker ring; a batch (pickle + tensors) must fit one slot of it.
_MAX_RING = 512 << 20
# Tensor-free batches with pickles below this take the pipe. Measured on the 2-core box
# (CPU of main + workers per batch, 2 workers): 64 ints (~0.4 KB) ~0.5 us/sample cheaper
# through the pipe in a StatefulLoader; lists of 64 byte strings of 1 KB in all: a tie;
# 4 KB: the ring 15% cheaper; 16-64 KB: 25-40% (benchmarks/RESULTS.md, issue 16).
_SMALL = 4 << 10
_PROBE = 64  # while the pipe is chosen, every _PROBE-th batch re-measures through the ring
# Storages up to this size arrive as copies, not views of the slot: a loop that keeps each
# batch's labels or ids (epoch metrics) would otherwise hold every slot, and every later batch
# would take the stock path (measured: 2x the workers' CPU, half the samples/s). A batch of
# 2,048 int64 labels is 16 KiB; a copy costs ~3 us (unpack of a batch with 3 small tensors:
# 29 us, 21 us as views).
_COPY_MAX = 16 << 10
_FD_TYPES: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]


def transport_available() -> bool:
    """Shared-memory rings need ``os.memfd_create`` (Linux)."""
    return hasattr(os, "memfd_create")


def worker_fds(n: int, ring_bytes: int = _MAX_RING) -> list[tuple[int, int, int]]:
    """One sparse ``memfd`` of ``ring_bytes`` per worker, made in the main process before the
    workers start: ``(fd, st_dev, st_ino)`` so that a worker can tell it really inherited it."""
    out = []
    for i in range(n):
        fd = os.memfd_create(f"unbroken-ring-w{i}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, ring_bytes)
        except OSError:
            os.close(fd)
            raise
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
    """What crosses the worker queue instead of a batch: the slot its pickle starts."""

    __slots__ = ("fd", "nbytes", "offset", "ring", "ring_bytes", "seq", "size", "slot")

    def __init__(
        self,
        ring: tuple[int, int],
        seq: int,
        slot: int,
        offset: int,
        size: int,
        nbytes: int,
        ring_bytes: int,
        fd: Any,
    ) -> None:
        # (worker pid, 1) for a worker's own ring, (0, worker id) for an inherited one
        self.ring = ring
        self.seq = seq
        self.slot = slot  # index in the ring's table
        self.offset = offset  # of the slot in the ring
        self.size = size  # of the slot
        self.nbytes = nbytes  # of the pickle, at the slot's start
        self.ring_bytes = ring_bytes
        self.fd = fd  # a DupFd on the first ticket of an own ring, else None

    def __reduce__(self) -> tuple[Any, ...]:
        return Ticket, (
            self.ring,
            self.seq,
            self.slot,
            self.offset,
            self.size,
            self.nbytes,
            self.ring_bytes,
            self.fd,
        )

    def __repr__(self) -> str:
        return f"Ticket(ring={self.ring}, seq={self.seq}, slot={self.slot}, nbytes={self.nbytes})"


class _Full(Exception):
    """The batch does not fit the slot."""


class _HandsOverFds(Exception):
    """The batch holds an object that only the stock path can carry (a storage, a
    connection, a tensor that needs grad, ...): it crosses as a file descriptor there."""


def _plain(t: torch.Tensor) -> bool:
    """A tensor the slot can carry as bytes + (dtype, size, stride, offset)."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_nested
        and not t.is_conj()
        and not t.is_neg()
    )


# --- worker side ------------------------------------------------------------------------


def _collate_ints(batch: list[Any], *, collate_fn_map: Any = None) -> torch.Tensor:
    # default_collate's rule (torch.tensor(batch)) through numpy: 1.5 us instead of 7 for 64
    # ints. Only when every element is exactly an int; bools, mixes and overflows keep it.
    if all(type(x) is int for x in batch):
        try:
            return torch.from_numpy(np.array(batch, dtype=np.int64))
        except OverflowError:
            pass
    return default_collate_fn_map[int](batch, collate_fn_map=collate_fn_map)


def _collate_floats(batch: list[Any], *, collate_fn_map: Any = None) -> torch.Tensor:
    if all(type(x) is float for x in batch):
        return torch.from_numpy(np.array(batch, dtype=np.float64))
    return default_collate_fn_map[float](batch, collate_fn_map=collate_fn_map)


class _Slot:
    __slots__ = ("index", "offset", "seq", "size")

    def __init__(self, index: int, offset: int, size: int) -> None:
        self.index, self.offset, self.size = index, offset, size
        self.seq = -1  # ticket in it, not released yet; -1: never used


class _Packing:
    """One batch being written into one slot: pickle bytes grow up from ``pos``, tensor bytes
    down from ``low``; the pickler's file object (``write``) and the tensor allocator."""

    __slots__ = ("base", "low", "mm", "pos", "slot", "tensors", "ring_ptr")

    def __init__(self, mm: mmap.mmap, ring_ptr: int, slot: _Slot) -> None:
        self.mm, self.ring_ptr, self.slot = mm, ring_ptr, slot
        self.base = slot.offset
        self.pos = slot.offset
        self.low = slot.offset + slot.size
        self.tensors: dict[int, int] = {}  # storage address -> its offset in the slot

    def write(self, b: Any) -> int:
        n = len(b) if isinstance(b, bytes) else memoryview(b).nbytes
        pos = self.pos
        if pos + n > self.low:
            raise _Full
        self.mm[pos : pos + n] = b
        self.pos = pos + n
        return n

    def alloc(self, nbytes: int) -> int:
        """Offset in the ring of ``nbytes`` of tensor memory, or raise :class:`_Full`."""
        low = (self.low - nbytes) & ~(_ALIGN - 1)
        if low < self.pos:
            raise _Full
        self.low = low
        return low

    def owns(self, ptr: int) -> bool:
        start = self.ring_ptr + self.base
        return start <= ptr < start + self.slot.size

    def ref(self, t: torch.Tensor) -> tuple[Any, ...]:
        """``t`` as arguments of :func:`_tensor_at`: its storage's bytes in this slot (offset,
        size) + its layout."""
        if not _plain(t):
            raise _HandsOverFds
        ptr = t.data_ptr()
        if t.numel() and self.owns(ptr):  # collated into this slot: no copy
            extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
            return (
                ptr - self.ring_ptr - self.base,
                extent * t.element_size(),
                t.dtype,
                tuple(t.shape),
                t.stride(),
                0,
            )
        st = t.untyped_storage()
        sptr, nbytes = st.data_ptr(), st.nbytes()
        off = self.tensors.get(sptr)
        if off is None:
            # The whole storage, once per batch: views of one storage still share it after.
            off = self.alloc(nbytes)
            if nbytes:
                ctypes.memmove(self.ring_ptr + off, sptr, nbytes)
            self.tensors[sptr] = off
        return (off - self.base, nbytes, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


class _Pickler(ForkingPickler):
    """``ForkingPickler`` whose tensors go into the slot (see :class:`_Packing`) and which
    refuses the other objects ``ForkingPickler`` sends as file descriptors."""

    def __init__(self, packing: _Packing) -> None:
        super().__init__(packing)
        self.packing = packing

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor:
            return _tensor_at, self.packing.ref(obj)
        if type(obj) in _FD_TYPES:
            raise _HandsOverFds
        return NotImplemented


class _Measure:
    """Counts what a batch needs in a slot (pickle + tensor bytes), without writing."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.tensor_bytes = 0
        self.seen: set[int] = set()

    def write(self, b: Any) -> int:
        n = len(b) if isinstance(b, bytes) else memoryview(b).nbytes
        self.nbytes += n
        return n


class _MeasurePickler(ForkingPickler):
    def __init__(self, m: _Measure) -> None:
        super().__init__(m)
        self.m = m

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor:
            if not _plain(obj):
                raise _HandsOverFds
            st = obj.untyped_storage()
            if st.data_ptr() not in self.m.seen:
                self.m.seen.add(st.data_ptr())
                self.m.tensor_bytes += st.nbytes() + _ALIGN
            # the largest offset a ring has: its pickled size is never short of the real one
            args = (_MAX_RING, st.nbytes(), obj.dtype, tuple(obj.shape), obj.stride(), 0)
            return _tensor_at, args
        if type(obj) in _FD_TYPES:
            raise _HandsOverFds
        return NotImplemented


class RingSender:
    """Worker side: collates and turns batches into tickets (or leaves them to the stock path).

    Args:
        max_slots: slots the ring may hold (batches sent and not yet released by the
            consumer, plus one being written); more are made only on demand.
        max_ring_bytes: address space of the ring (its memory is committed only where slots
            are written).
        worker_id, fd_spec: this worker's entry of :func:`worker_fds`, when inherited.
    """

    def __init__(
        self,
        max_slots: int = _MAX_SLOTS,
        max_ring_bytes: int = _MAX_RING,
        *,
        worker_id: int = 0,
        fd_spec: tuple[int, int, int] | None = None,
    ) -> None:
        if not 1 <= max_slots <= _MAX_SLOTS:
            raise ValueError(f"max_slots={max_slots} must be in 1..{_MAX_SLOTS}")
        self.max_slots = max_slots
        self.ring_bytes = max_ring_bytes
        self._wid = worker_id
        self._fd = _inherited(fd_spec)
        self._disabled = not transport_available()
        self._mm: mmap.mmap | None = None
        self._ptr = 0
        self._done: np.ndarray | None = None
        self._own_fd: int | None = None
        self._sent_fd = False
        self._key = (0, worker_id)
        self._slots: list[_Slot] = []
        self._top = _HEADER  # where the next new slot goes
        self._seq = 0
        self._want = 0  # bytes the last batch needed: the arena a collate starts from
        self._pipe_left = 0  # batches left on the pipe before the next probe of the ring
        self._packing: _Packing | None = None  # the slot a collate is writing into
        self._said_held = False  # warned that the consumer holds every slot
        self._map: dict[Any, Any] = {
            **default_collate_fn_map,
            torch.Tensor: self._stack,
            float: _collate_floats,
            int: _collate_ints,
        }

    # --- the ring ----------------------------------------------------------------------

    def _open(self) -> mmap.mmap | None:
        if self._mm is not None or self._disabled:
            return self._mm
        try:
            if self._fd is not None:
                fd = self._fd
                self.ring_bytes = os.fstat(fd).st_size
            else:
                fd = os.memfd_create(f"unbroken-ring-{os.getpid()}", os.MFD_CLOEXEC)
                self._own_fd = fd
                self._key = (os.getpid(), 1)
                os.ftruncate(fd, self.ring_bytes)
            self._mm = mmap.mmap(fd, self.ring_bytes)
        except OSError as e:
            log.warning(
                "shared-memory batch transport off in worker %d (%s); batches take the pipe",
                os.getpid(),
                e,
            )
            self._disabled = True
            return None
        self._ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._done = np.frombuffer(self._mm, np.int64, _MAX_SLOTS, _DONE)
        return self._mm

    def _free(self, s: _Slot) -> bool:
        done = self._done
        return s.seq < 0 or (done is not None and int(done[s.index]) == s.seq + 1)

    def _acquire(self, need: int, but: _Slot | None = None) -> _Slot | None:
        """The smallest free slot (not ``but``) of at least ``need`` bytes; a new one if none
        (``need`` > 0 only), or None when the ring is out of slots or space."""
        best = None
        for s in self._slots:
            if s is but:
                continue
            if s.size >= need and (best is None or s.size < best.size) and self._free(s):
                best = s
                if s.size == need:
                    break
        if best is not None or need <= 0:
            return best
        size = -(-(need + (need >> 2)) // _GRAIN) * _GRAIN
        if len(self._slots) >= self.max_slots:
            if not self._said_held:
                self._said_held = True
                log.warning(
                    "all %d slots of DataLoader worker %d's batch ring hold batches the "
                    "training process has not freed (tensors it keeps, or batches queued by "
                    "prefetch); until some are freed, batches take torch's slower per-tensor "
                    "path. Keep copies (`t.clone()`) of batch tensors held across steps",
                    self.max_slots,
                    self._wid,
                )
            return None
        if self._top + size > self.ring_bytes:
            return None
        s = _Slot(len(self._slots), self._top, size)
        self._slots.append(s)
        self._top += size
        return s

    # --- batches -----------------------------------------------------------------------

    def collate(self, samples: list[Any], collate_fn: Callable[[list[Any]], Any]) -> Any:
        """``collate_fn(samples)`` packed as by :meth:`pack`; ``default_collate``'s tensors
        are stacked straight into a slot (same values, types and shapes)."""
        if collate_fn is not default_collate or self._disabled or self._pipe_left:
            return self.pack(collate_fn(samples))
        mm = self._open()
        slot = self._acquire(self._want) if mm is not None and self._want else None
        if mm is not None and slot is not None:
            self._packing = _Packing(mm, self._ptr, slot)
        try:
            batch = _collate(samples, collate_fn_map=self._map)
        finally:
            packing, self._packing = self._packing, None
        return self._ship(batch, packing)

    def _stack(self, batch: list[Any], *, collate_fn_map: Any = None) -> Any:
        # default_collate's tensor rule, with the output in the slot when it fits; elsewhere
        # on the heap (not in a new shared segment: it is copied into a slot when packed).
        elem = batch[0]
        p = self._packing
        if p is None or not _plain(elem):
            if _plain(elem):
                return torch.stack(batch, 0)
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        shape = (len(batch), *elem.shape)
        nbytes = elem.element_size() * elem.numel() * len(batch)
        try:
            off = p.alloc(nbytes)
        except _Full:
            return torch.stack(batch, 0)
        out = (
            torch.frombuffer(
                p.mm, dtype=elem.dtype, count=nbytes // elem.element_size(), offset=off
            )
            if nbytes
            else torch.empty(shape, dtype=elem.dtype)
        )
        return torch.stack(batch, 0, out=out.view(shape))

    def pack(self, batch: Any) -> Any:
        """A :class:`Ticket` for ``batch``, or ``batch`` itself for the stock path."""
        if self._disabled:
            return batch
        if self._pipe_left:
            self._pipe_left -= 1
            return batch
        return self._ship(batch, None)

    def _ship(self, batch: Any, packing: _Packing | None) -> Any:
        mm = self._open()
        if mm is None:
            return batch
        try:
            if packing is None:
                slot = self._acquire(self._want) if self._want else None
                packing = _Packing(mm, self._ptr, slot) if slot is not None else None
            if packing is not None:
                try:
                    return self._write(batch, packing)
                except _Full:
                    pass
            need = self._measure(batch)
            slot = self._acquire(need, packing.slot if packing is not None else None)
            if slot is not None:
                return self._write(batch, _Packing(mm, self._ptr, slot))
        except _HandsOverFds:
            # A stream's batches are alike: they all keep torch's path from now on.
            self._disabled = True
        except _Full:  # pragma: no cover - _measure sized the slot
            pass
        return self._stock(batch, packing)

    def _measure(self, batch: Any) -> int:
        m = _Measure()
        _MeasurePickler(m).dump(batch)
        return m.nbytes + m.tensor_bytes + _ALIGN

    def _write(self, batch: Any, p: _Packing) -> Any:
        _Pickler(p).dump(batch)
        slot = p.slot
        nbytes = p.pos - p.base
        used = nbytes + (p.base + slot.size - p.low)
        if not p.tensors and p.low == p.base + slot.size and nbytes < _SMALL:
            # tensor-free and small: the pipe is cheaper; this one is written already
            self._pipe_left = _PROBE - 1
        self._want = used
        slot.seq = self._seq
        fd = None
        if self._own_fd is not None and not self._sent_fd:
            fd = DupFd(self._own_fd)
            self._sent_fd = True
        t = Ticket(
            self._key, self._seq, slot.index, slot.offset, slot.size, nbytes, self.ring_bytes, fd
        )
        self._seq += 1
        return t

    def _stock(self, batch: Any, packing: _Packing | None) -> Any:
        if packing is None or packing.low == packing.base + packing.slot.size:
            return batch
        # Tensors collated into the slot: the queue pickles the batch later, in its feeder
        # thread, when the slot may be written again - they leave it now.
        return map_tensors(lambda t: t.clone() if packing.owns(t.data_ptr()) else t, batch)

    def close(self) -> None:
        if self._mm is not None:
            self._done = None
            try:
                self._mm.close()
            except BufferError:
                pass  # tensors of a batch not sent yet still view it; unmapped with them
            self._mm = None
        if self._own_fd is not None:
            os.close(self._own_fd)
            self._own_fd = None


# --- main side --------------------------------------------------------------------------


_CTX = threading.local()  # the slot being unpickled, for _tensor_at


def _tensor_at(
    offset: int,
    nbytes: int,
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    elem: int,
) -> torch.Tensor:
    """A tensor whose storage is the ``nbytes`` at ``offset`` in the slot being unpacked,
    ``elem`` elements into it, laid out as ``size``/``stride``: a view of the slot (no copy),
    or of a copy of the storage when it is at most ``_COPY_MAX`` bytes (one copy per storage:
    views of it still share it)."""
    slot = getattr(_CTX, "slot", None)
    if slot is None:
        raise RuntimeError("a batch-transport tensor reference unpickled outside its slot")
    if nbytes <= _COPY_MAX:
        copy = _CTX.copies.get((offset, nbytes))  # (an empty storage shares an offset)
        if copy is None:
            src = slot[offset : offset + nbytes]
            if _CTX.pin or not nbytes:  # (from_numpy's empty tensor has stride 0: no view)
                copy = torch.empty(nbytes, dtype=torch.uint8, pin_memory=_CTX.pin)
                copy.numpy()[:] = src
            else:
                copy = torch.from_numpy(src.copy())
            _CTX.copies[offset, nbytes] = copy
        return copy.view(dtype).as_strided(size, stride, elem)
    base = _CTX.base
    if base is None:
        base = _CTX.base = torch.from_numpy(slot)
        _CTX.views = {}
    view = _CTX.views.get(dtype)
    if view is None:
        view = _CTX.views[dtype] = base.view(dtype)
    return view.as_strided(size, stride, offset // view.element_size() + elem)


class _Mapped:
    """One ring as the main process maps it."""

    def __init__(self, mm: mmap.mmap, pin: bool) -> None:
        self.mm = mm
        self.done = np.frombuffer(mm, np.int64, _MAX_SLOTS, _DONE)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm)) if pin else 0
        self.pin = pin
        self.registered: dict[int, int] = {}  # slot index -> its address
        self.refs: dict[int, Any] = {}  # slot index -> weakref on its live batch's buffer
        self.closed = False
        self.unmapped = False
        # A ring collected unclosed (its persistent loader dropped mid-epoch) must not leave
        # CUDA a registration over memory unmapped under it: a later pinned allocation at
        # that address would fail with "resource already mapped".
        self._drop = weakref.finalize(self, _unregister_and_unmap, mm, self.registered)
        self._drop.atexit = False  # an exiting process drops its mappings and CUDA together

    def release(self, slot: int, value: int) -> None:
        self.refs.pop(slot, None)
        if not self.unmapped:
            self.done[slot] = value

    def unmap(self) -> None:
        """Once closed and no batch views it: unregister (CUDA) and unmap."""
        if not self.closed or self.refs or self.unmapped:
            return
        self.unmapped = True
        # every copy from the slots is done (their events were waited for): no synchronize
        _unregister(self.registered)
        self._drop()


def _unregister(registered: dict[int, int]) -> None:
    for ptr in registered.values():
        torch.cuda.cudart().cudaHostUnregister(ptr)
    registered.clear()


def _unregister_and_unmap(mm: mmap.mmap, registered: dict[int, int]) -> None:
    """End the ring's CUDA registrations, then unmap it. Registrations still here when the
    ring is collected unclosed may have copies queued: synchronize before ending them."""
    if registered:
        for device in range(torch.cuda.device_count()):  # GC may run on any thread
            torch.cuda.synchronize(device)
        _unregister(registered)
    try:
        mm.close()
    except BufferError:  # a batch still views a slot: unmapped when the last view goes
        pass


class _PinnedReleases:
    """CUDA: slots of dead batches wait for an event on the current stream before their
    worker may overwrite them (or their ring is unregistered and unmapped) - a non-blocking
    copy from the batch may still be reading. One per process, shared by every receiver, so
    what an ended loader left behind is finished by the next one's batches; the reaping runs
    on the thread that unpacks batches (the training loop's)."""

    def __init__(self) -> None:
        self.dead: collections.deque[tuple[_Mapped, int, int]] = collections.deque()
        self.waiting: collections.deque[tuple[Any, list[tuple[_Mapped, int, int]]]] = (
            collections.deque()
        )

    def died(self, ring: _Mapped, slot: int, value: int, _ref: Any) -> None:
        self.dead.append((ring, slot, value))  # any thread (GC); deque.append is atomic

    def reap(self) -> None:
        if self.dead:
            batch = []
            while self.dead:
                batch.append(self.dead.popleft())
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            self.waiting.append((ev, batch))
        while self.waiting and self.waiting[0][0].query():
            for ring, slot, value in self.waiting.popleft()[1]:
                ring.release(slot, value)
                ring.unmap()


_PINNED = _PinnedReleases()


class RingReceiver:
    """Main side: tickets back to batches; anything else passes through unchanged.

    ``fds``: the :func:`worker_fds` the workers were started with; the receiver closes them.
    ``pin``: register slots as CUDA pinned memory (only when CUDA is available); batches that
    took the stock path are pinned by a copy here.
    """

    def __init__(self, fds: list[tuple[int, int, int]] | None = None, pin: bool = False) -> None:
        self._rings: dict[tuple[int, int], _Mapped] = {}
        self._fds = [f for f, _, _ in fds or ()]
        self.pin = pin and torch.cuda.is_available()
        self._pinned = _PINNED if self.pin else None
        self._pin_failed = False
        for wid, fd in enumerate(self._fds):
            self._rings[(0, wid)] = _Mapped(mmap.mmap(fd, os.fstat(fd).st_size), self.pin)
        # backstop for a loader dropped without finishing its iteration (persistent workers)
        self._finalizer = weakref.finalize(self, _close_fds, list(self._fds))

    def unpack(self, item: Any) -> Any:
        if self._pinned is not None:
            self._pinned.reap()
        if not isinstance(item, Ticket):
            return self._pin_copy(item) if self.pin else item
        ring = self._rings.get(item.ring)
        if ring is None:
            ring = self._map(item)
        slot = np.frombuffer(ring.mm, np.uint8, item.size, item.offset)
        registered = self.pin and self._register(ring, item)
        _CTX.slot, _CTX.base, _CTX.copies, _CTX.pin = slot, None, {}, registered
        try:
            with memoryview(slot) as view, view[: item.nbytes] as src:  # type: ignore[arg-type]
                batch = pickle.loads(src)
        finally:
            used = _CTX.base is not None  # a view of the slot was made
            _CTX.slot = _CTX.base = _CTX.views = _CTX.copies = None
        value = item.seq + 1
        if not used:
            ring.release(item.slot, value)  # nothing views the slot: free it now
        else:
            died = (
                partial(self._pinned.died, ring, item.slot, value)
                if self._pinned is not None
                else partial(_released, ring, item.slot, value)
            )
            ring.refs[item.slot] = weakref.ref(slot, died)
        if self.pin and not registered:  # (small tensors' copies too: made unpinned then)
            batch = self._pin_copy(batch)
        return batch

    def _register(self, ring: _Mapped, t: Ticket) -> bool:
        if t.slot in ring.registered:
            return True
        if self._pin_failed:
            return False
        ptr = ring.ptr + t.offset
        try:
            # 1 = cudaHostRegisterPortable, as torch.cuda._pin_memory_utils registers memory
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, t.size, 1))
        except Exception as e:  # noqa: BLE001 - a CudaError, or a runtime without the call
            self._pin_failed = True
            log.warning(
                "cudaHostRegister of a %d-byte batch slot failed (%s); batches are pinned by a "
                "copy instead",
                t.size,
                e,
            )
            return False
        ring.registered[t.slot] = ptr
        return True

    @staticmethod
    def _pin_copy(batch: Any) -> Any:
        return map_tensors(lambda t: t if t.is_pinned() else t.pin_memory(), batch)

    def _map(self, t: Ticket) -> _Mapped:
        if t.ring[0] == 0:
            raise RuntimeError(f"batch transport: {t!r} names worker {t.ring[1]}, not started here")
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
        ring = self._rings[t.ring] = _Mapped(mm, self.pin)
        return ring

    def close(self) -> None:
        """Unmap every ring no batch views any more; the others are unmapped when their last
        batch is gone (their slots are never written again: the workers are gone) - on CUDA,
        once the copies from them are done, as seen by the next receiver's or close's reap."""
        for r in self._rings.values():
            r.closed = True
            # a slot leaves ``refs`` only once the copies from it are done (CUDA: its event)
            r.unmap()
        if self._pinned is not None:
            self._pinned.reap()
        self._rings.clear()
        self._finalizer()
        self._fds = []


def _released(ring: _Mapped, slot: int, value: int, _ref: Any) -> None:
    ring.release(slot, value)
    ring.unmap()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
