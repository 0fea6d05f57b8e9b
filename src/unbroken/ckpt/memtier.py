"""The memory tier: the loop's snapshot kept in node memory that outlives the worker
(issue 25, C-TIERS; design in ARCHITECTURE.md "The memory tier").

Each rank owns two slot files in a private directory on tmpfs
(``/dev/shm/unbroken-<uid>/<job>/rank-<r>/slot-{0,1}``). :class:`SlotStore` publishes into
the slot that does *not* hold the newest complete step, header last
(:meth:`SlotStore.publish`), and :meth:`SlotStore.newest` returns the verified slot of
highest generation: the slot in flight never hides the last complete one, and a torn or
damaged slot falls back to the other, then to none. :class:`MemoryTier` is the
Checkpointer's side.

Every byte of a slot is untrusted (T-BOUNDED, T-FALL-BACK): any failure is a
:class:`SlotDamaged` reason, never an exception out of :meth:`newest`. The directory is
private (T-SHARED-NODE): owned by this user, not writable by group or others, no symlink;
slots opened with ``O_NOFOLLOW``, mode 0600; one live publisher per rank directory
(``flock``).

The slot format and the checks on reading it: ARCHITECTURE.md, "The memory tier" > the
slot format.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import mmap
import os
import struct
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

from unbroken.ckpt import codec, schema
from unbroken.ckpt.bounds import Budget, load_json
from unbroken.ckpt.collectives import Comm
from unbroken.ckpt.load import Loader, NotLoaded
from unbroken.ckpt.manifest import CheckpointManifest, TensorEntry, torch_dtype
from unbroken.ckpt.memplan import Plan
from unbroken.ckpt.save import Job
from unbroken.ckpt.schema import check_state
from unbroken.ckpt.state import TrainState
from unbroken.ckpt.verify import Verified
from unbroken.common import memdir
from unbroken.common.fs import (
    PrivateDirError,
    close_lock_fd,
    open_lock_fd,
    open_private,
    private_dir,
)
from unbroken.common.memdir import ENV

__all__ = [
    "ENV",
    "HEADER_BYTES",
    "MemorySnapshot",
    "MemoryTier",
    "SlotDamaged",
    "Pending",
    "SlotStore",
    "TierBusy",
    "default_dir",
]

log = logging.getLogger(__name__)


MAGIC = b"UBSLOT\r\n"
VERSION = 2
# magic, version, meta length, step, generation, payload length, payload digest, header xxh3-64
_HEAD = struct.Struct("<8sIIqqQ16sQ")
DIGEST_PART = 64 << 20
"""The payload's digest (format 2) is the xxh3-128 of the xxh3-128s of its consecutive
``DIGEST_PART``-byte parts, which hash in parallel: a 2.06 GiB slot in one xxh3 stream over its
tmpfs mapping took 0.29 s, in two threads 0.16 s (format 1 was the one stream). The digest
depends on the bytes only, never on how many threads computed it."""
_DIGEST_THREADS = 2
HEADER_BYTES = 64 << 10
"""Bytes reserved at the start of a slot for the header and its meta JSON."""
_MAX_META = HEADER_BYTES - _HEAD.size
_ALIGN = 64
_MAX_DIMS = 64
_MAX_STEP = 1 << 62
SLOTS = 2
BACKGROUND_BYTES = 8 << 20
"""A slot at least this large is checksummed in the tier's thread; a smaller one in the
loop: its xxh3 (~0.1 ms per MiB) costs less than handing it to a thread (measured on the
demo model, 1.5 MB, 2 loaded cores: 2.6 ms per publish in ``SimpleQueue.put`` and the GIL
hand-off, against 0.04 ms for the hash)."""


class SlotDamaged(ValueError):
    """A slot that cannot be used; ``reason`` is a short slug (``missing``, ``torn``,
    ``checksum``, ``bad-header``, ``bad-payload``, ``unreadable``)."""

    def __init__(self, path: str, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {reason}: {detail}")
        self.path, self.reason, self.detail = path, reason, detail


class TierBusy(RuntimeError):
    """Another live process publishes into this rank's memory-tier directory."""


def default_dir(root: str) -> str:
    """``$UNBROKEN_MEMORY_TIER``, else ``/dev/shm/unbroken-<uid>/<job>``, where ``<job>``
    is derived from the checkpoint root's real path: a restarted job finds its slots, two
    jobs of one user never share them."""
    env = os.environ.get(ENV)
    if env:
        return env
    return memdir.job_dir(os.path.realpath(root))


@dataclass
class MemorySnapshot:
    """One verified slot: ``tensors`` are read-only zero-copy views of the slot's mapping
    (copy them into live tensors; never hand them out)."""

    path: str
    step: int
    generation: int
    meta: dict[str, Any]
    tree: Any
    rng: Any
    tensors: dict[str, torch.Tensor] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class _Head:
    step: int
    generation: int
    payload_len: int
    digest: bytes
    meta: dict[str, Any]


def _pad(n: int) -> int:
    return -n % _ALIGN


_HEADER_ZEROS = memoryview(bytes(HEADER_BYTES))
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_SPACES = b" " * 65536


_pool: tuple[int, ThreadPoolExecutor] | None = None


def _digest_pool() -> ThreadPoolExecutor:
    """This process's hashing threads (a forked child makes its own: the parent's threads
    are not in it)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(_DIGEST_THREADS, "unbroken-slot-hash"))
    return _pool[1]


def payload_digest(payload: memoryview) -> bytes:
    """A slot payload's digest (see :data:`DIGEST_PART`); xxh3 releases the GIL."""
    parts = [payload[a : a + DIGEST_PART] for a in range(0, len(payload), DIGEST_PART)]
    try:
        if len(parts) > 1:
            digests = list(_digest_pool().map(xxhash.xxh3_128_digest, parts))
        else:
            digests = [xxhash.xxh3_128_digest(payload)]
        return xxhash.xxh3_128_digest(b"".join(digests))
    finally:
        for p in parts:
            p.release()


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _number_free(obj: Any) -> bool:
    """Only strings, None, lists and str-keyed dicts: ``==`` on such a tree is exact (it
    is not for numbers: 1 == True == 1.0, 0.0 == -0.0)."""
    if obj is None or type(obj) is str:
        return True
    if type(obj) is list:
        return all(map(_number_free, obj))
    if type(obj) is dict:
        return all(type(k) is str for k in obj) and all(map(_number_free, obj.values()))
    return False


def _always(_value: Any) -> bool:
    return True


class _JsonParts:
    """The JSON of a publish's parts that repeat from step to step, reused while equal
    (issue 25 item 3): a component whose encoded tree holds no number (a model's tensor
    references) and each RNG stream that did not move. A component holding numbers is
    encoded afresh every time, so a reused byte is always the byte ``json.dumps`` writes.
    RNG states are compared as captured: their types are fixed by the generators (ints,
    strings, arrays as base64), and a stream that moved never compares equal."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str], tuple[Any, bytes]] = {}

    def _part(self, where: tuple[str, str], value: Any, exact: Callable[[Any], bool]) -> bytes:
        """``value``'s JSON; kept for the next publish when ``exact(value)``: a later value
        equal to a kept one is then the same JSON."""
        hit = self._parts.get(where)
        if hit is not None and hit[0] == value:
            return hit[1]
        raw = _dumps(value)
        if exact(value):
            self._parts[where] = (value, raw)
        else:
            self._parts.pop(where, None)
        return raw

    def tree(self, tree: Any) -> bytes:
        comps = tree.get("components") if isinstance(tree, dict) else None
        if not isinstance(comps, dict):
            return _dumps(tree)
        inner = b", ".join(
            _dumps(k) + b": " + self._part(("c", k), v, _number_free) for k, v in comps.items()
        )
        rest = {k: v for k, v in tree.items() if k != "components"}
        head = _dumps(rest)[:-1]  # the other keys, then the components
        return head + (b", " if rest else b"") + b'"components": {' + inner + b"}}"

    def rng(self, rng: Any) -> bytes:
        if not isinstance(rng, dict) or not all(type(k) is str for k in rng):
            return _dumps(rng)
        inner = b", ".join(
            _dumps(k) + b": " + self._part(("r", k), v, _always) for k, v in rng.items()
        )
        return b"{" + inner + b"}"


class _Mapped:
    """One slot file mapped for publishing, laid out for one key table: the JSON gets
    ``room`` bytes (the blob padded with JSON whitespace, so a tree that grows a digit
    keeps the layout), each tensor a typed view of the mapping at its 64-byte-aligned
    place. A publish is then one ``_foreach_copy_`` into the views and one xxh3 pass over
    the mapping: no per-tensor Python work, no intermediate buffer (issue 25 item 3)."""

    def __init__(
        self,
        fd: int,
        sig: tuple[tuple[str, torch.dtype, torch.Size], ...],
        blob: int,
        *,
        populate: bool = False,
    ) -> None:
        self.sig, self.blob = sig, blob
        self.room = blob + max(4096, blob // 2)
        self.room += _pad(8 + self.room)  # the tensors start 64-byte aligned
        offsets, end = [], 8 + self.room
        for _k, dt, shape in sig:
            n = math.prod(shape) * dt.itemsize
            offsets.append((end, n, dt, shape))
            end += n + _pad(n)
        self.end = end
        os.ftruncate(fd, 0)  # every byte the layout does not write (padding) is zero
        os.ftruncate(fd, HEADER_BYTES + end)
        os.posix_fallocate(fd, 0, HEADER_BYTES + end)  # tmpfs full: ENOSPC here, not SIGBUS
        self.head_len = 0  # header bytes that may be non-zero (the file is zero from here)
        self.mm = mmap.mmap(fd, HEADER_BYTES + end, flags=mmap.MAP_SHARED)
        if populate:  # the page faults of a first copy, taken here (off the loop)
            with contextlib.suppress(OSError):  # a kernel before 5.14: faults on first copy
                self.mm.madvise(_MADV_POPULATE_WRITE)
        self.views = [
            torch.frombuffer(self.mm, dtype=torch.uint8, count=n, offset=HEADER_BYTES + off)
            .view(dt)
            .view(shape)
            for off, n, dt, shape in offsets
            if n
        ]

    def fill(self, blob: bytes, tensors: list[torch.Tensor]) -> None:
        """Write the payload (the JSON and a copy of ``tensors``); :meth:`digest` next."""
        mm, b = self.mm, HEADER_BYTES
        mm[b : b + 8] = struct.pack("<Q", self.room)
        mm[b + 8 : b + 8 + len(blob)] = blob
        gap = self.room - len(blob)
        while gap:  # JSON whitespace up to the room's end (stale bytes of a longer blob)
            at = b + 8 + self.room - gap
            n = min(gap, len(_SPACES))
            mm[at : at + n] = _SPACES[:n]
            gap -= n
        with torch.no_grad():
            torch._foreach_copy_(self.views, tensors)

    def digest(self) -> bytes:
        """The payload's digest (:func:`payload_digest`)."""
        with memoryview(self.mm) as whole, whole[HEADER_BYTES:] as payload:
            return payload_digest(payload)

    def close(self) -> None:
        self.views.clear()  # the views export the mapping's buffer
        try:
            self.mm.close()
        except BufferError:  # a view still referenced elsewhere: the mapping goes with it
            pass


@dataclass(frozen=True)
class Pending:
    """A publish whose payload is written but not yet checksummed: its slot's header is
    zero (a crash now leaves a torn slot; the other slot holds the last complete step)."""

    slot: int
    step: int
    meta: bytes
    mapped: _Mapped = field(repr=False)


class SlotStore:
    """The two slots of one rank under ``directory`` (see the module docstring).

    ``directory`` (the job's) and its ``rank-<r>`` subdirectory are created private or
    refused with :class:`~unbroken.common.fs.PrivateDirError`. The first :meth:`publish`
    takes the rank directory's lock (a second live publisher is refused with
    :class:`TierBusy`); :meth:`close` releases it.

    A publish is two halves (issue 25 speed item 3): :meth:`begin` copies the snapshot into
    the slot (what the training loop must wait for), :meth:`finish` checksums it and writes
    the header (another thread may run it); :meth:`publish` is both. One publish at a time:
    a :meth:`begin` while another is pending is refused. ``on_complete(path, step,
    generation)`` is called by :meth:`_complete`, the one place a slot becomes complete,
    in the thread that finished it (a hook for what follows, e.g. a peer replica).
    """

    def __init__(self, directory: str, rank: int) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r} must be a non-negative integer")
        self.directory = directory
        self.rank = rank
        memdir.create(directory)
        self.rank_dir = private_dir(
            os.path.join(directory, f"rank-{rank}"), purpose="memory-tier rank directory"
        )
        self._lock_fd: int | None = None
        self._fds: dict[int, int] = {}  # slot -> fd, opened once by the publisher
        self._maps: dict[int, _Mapped] = {}  # slot -> its mapping, while the layout holds
        self._table: tuple[Any, bytes] | None = None  # the key table's JSON, per signature
        self._json = _JsonParts()
        self._newest: int | None = None  # the slot holding the newest verified step
        self._generation = 0
        self._pending: Pending | None = None
        self.on_complete: Callable[[str, int, int], None] | None = None

    def slot_path(self, i: int) -> str:
        return os.path.join(self.rank_dir, f"slot-{i}")

    # --- publishing -------------------------------------------------------------------------

    def _take_lock(self) -> None:
        if self._lock_fd is not None:
            return
        path = os.path.join(self.rank_dir, "lock")
        fd = open_lock_fd(path)  # not kept by a DataLoader worker forked from this rank
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            close_lock_fd(fd)
            raise TierBusy(
                f"{self.rank_dir}: another live process publishes into this memory tier "
                "(its lock is held); stop it, or give this job another directory "
                f"(${ENV} or memory_dir)"
            ) from None
        self._lock_fd = fd

    def _target(self) -> int:
        """The slot to write: not the one holding the newest verified step."""
        if self._newest is None:
            snap, _ = self.newest()
            if snap is not None:
                self._newest = int(snap.path.endswith("slot-1"))
                self._generation = snap.generation
            else:
                self._generation = max(
                    (h.generation for h in map(self.head, range(SLOTS)) if h), default=0
                )
        return 0 if self._newest is None else 1 - self._newest

    def publish(
        self,
        step: int,
        tree: Any,
        rng: Any,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Write one complete snapshot as ``step``: ``tree``/``rng`` are codec-encoded
        (tensor references in ``tree`` name keys of ``tensors``); ``tensors`` are tensors
        of any layout and device (copied into the slot). Returns the slot's path."""
        return self.finish(self.begin(step, tree, rng, tensors, meta))

    def begin(
        self,
        step: int,
        tree: Any,
        rng: Any,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
    ) -> Pending:
        """The first half of :meth:`publish`: invalidate the slot that does not hold the
        newest complete step, and copy the snapshot into it. Until :meth:`finish`, that
        slot is torn and the other one is the newest complete."""
        sig = tuple((k, t.dtype, t.shape) for k, t in tensors.items())
        srcs = [t for t in tensors.values() if t.numel()]
        return self.begin_rendered(step, self._json.tree(tree), rng, sig, srcs, meta)

    def begin_rendered(
        self,
        step: int,
        state_json: bytes,
        rng: Any,
        sig: tuple[tuple[str, torch.dtype, torch.Size], ...],
        srcs: list[torch.Tensor],
        meta: Mapping[str, Any] | None = None,
    ) -> Pending:
        """:meth:`begin` of a state already rendered: its JSON, its codec-encoded RNG, the
        key table ``sig`` (key, dtype, shape) and the tensors with elements, in its order
        (issue 25 item 2: a publish from a plan, ``ckpt/memplan.py``)."""
        if not isinstance(step, int) or not 0 <= step < _MAX_STEP:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        if self._pending is not None:
            raise RuntimeError(
                f"{self.slot_path(self._pending.slot)}: the publish of step "
                f"{self._pending.step} is not finished; finish() it before the next begin()"
            )
        self._take_lock()
        i = self._target()
        meta_raw = json.dumps({**(meta or {}), "rank": self.rank}).encode()
        if len(meta_raw) > _MAX_META:
            raise ValueError(f"memory-tier meta of {len(meta_raw)} bytes exceeds {_MAX_META}")
        fd = self._open_slot(i)
        os.pwrite(fd, bytes(_HEAD.size), 0)  # invalidate first: a torn slot never verifies
        if self._table is None or (self._table[0] is not sig and self._table[0] != sig):
            table = {
                k: {"dtype": str(dt).removeprefix("torch."), "shape": list(shape)}
                for k, dt, shape in sig
            }
            self._table = (sig, json.dumps(table).encode())
        blob = b"".join(
            (b'{"state": ', state_json, b', "rng": ', self._json.rng(rng),
             b', "tensors": ', self._table[1], b"}")
        )  # fmt: skip
        m = self._maps.get(i)
        if m is None or m.sig != sig or len(blob) > m.room:
            if m is not None:
                m.close()
            m = self._maps[i] = _Mapped(fd, sig, len(blob))
        m.fill(blob, srcs)
        self._pending = Pending(i, step, meta_raw, m)
        return self._pending

    def finish(self, p: Pending) -> str:
        """The second half of :meth:`publish`: checksum the slot ``p`` filled and write
        its header, which makes it complete. Returns the slot's path."""
        if self._pending is not p:
            raise RuntimeError(
                f"{self.slot_path(p.slot)}: step {p.step} is not the pending publish"
            )
        try:
            digest = p.mapped.digest()
            gen = self._generation + 1
            head = _pack(p.step, gen, p.mapped.end, digest, p.meta)
            # the header last, in one system call (a SIGKILL cannot cut it in two), zeros
            # over what a longer header left: a shorter meta leaves no stale byte
            tail = max(0, p.mapped.head_len - len(head))
            os.pwrite(self._fds[p.slot], head + _HEADER_ZEROS[:tail], 0)
            p.mapped.head_len = len(head)
        finally:
            self._pending = None
        self._complete(p.slot, p.step, gen)
        return self.slot_path(p.slot)

    def prepare(self, p: Pending) -> None:
        """After ``p`` completed: map the other slot with ``p``'s layout and fault its pages
        in, so the next publish's copy is a copy (issue 25 item 2: a 2 GiB slot's first
        copy took 1.4 s here against 0.5 s for later ones, its page faults; and the
        allocation 0.3-0.4 s). Only a slot this process has not mapped yet; never the one
        holding the newest complete step (``p``'s)."""
        i = 1 - p.slot
        if i in self._maps or self._newest != p.slot or self._pending is not None:
            return
        m = p.mapped
        self._maps[i] = _Mapped(self._open_slot(i), m.sig, m.blob, populate=True)

    def _complete(self, i: int, step: int, gen: int) -> None:
        """Slot ``i`` now holds ``step`` complete (its header is written): the one place
        this happens."""
        self._newest, self._generation = i, gen
        if self.on_complete is not None:
            try:
                self.on_complete(self.slot_path(i), step, gen)
            except Exception:  # a hook's fault never stops the tier
                log.exception("memory tier: on_complete hook failed for step %d", step)

    def _open_slot(self, i: int) -> int:
        if i in self._fds:
            return self._fds[i]
        path = self.slot_path(i)
        try:
            self._fds[i] = open_private(path, os.O_RDWR | os.O_CREAT)
            return self._fds[i]
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise PrivateDirError(
                    f"{path}: a symlink in place of a memory-tier slot; remove it"
                ) from None
            raise

    # --- reading ----------------------------------------------------------------------------

    def head(self, i: int) -> _Head | None:
        """Slot ``i``'s header when it verifies (the payload is not read), else None."""
        got = self.check_head(i)
        return got if isinstance(got, _Head) else None

    def check_head(self, i: int) -> _Head | SlotDamaged | None:
        """Slot ``i``'s header when it verifies, why not when it is there and does not,
        None when there is no slot ``i``."""
        path = self.slot_path(i)
        try:
            fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except (OSError, PrivateDirError) as e:
            return SlotDamaged(path, "unreadable", str(e))
        try:
            return _read_head(fd, path, os.fstat(fd).st_size)
        except SlotDamaged as e:
            return e
        finally:
            os.close(fd)

    def read(self, i: int) -> MemorySnapshot:
        """Verify and decode slot ``i``; raises :class:`SlotDamaged` for any fault."""
        path = self.slot_path(i)
        try:
            fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise SlotDamaged(path, "missing", "no slot written") from None
        except (OSError, PrivateDirError) as e:
            raise SlotDamaged(path, "unreadable", str(e)) from None
        try:
            return _read_slot(fd, path)
        except SlotDamaged:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # any fault of untrusted bytes is damage
            first = (str(e).splitlines() or [""])[0]
            raise SlotDamaged(path, "bad-payload", f"{type(e).__name__}: {first}") from e
        finally:
            os.close(fd)

    def newest(self) -> tuple[MemorySnapshot | None, list[SlotDamaged]]:
        """The verified slot of highest generation (None when neither verifies), and why
        each other slot was not taken."""
        good: list[MemorySnapshot] = []
        bad: list[SlotDamaged] = []
        for i in range(SLOTS):
            try:
                good.append(self.read(i))
            except SlotDamaged as e:
                bad.append(e)
        good.sort(key=lambda s: s.generation, reverse=True)
        if good:
            self._newest = int(good[0].path.endswith("slot-1"))
            self._generation = max(self._generation, good[0].generation)
        return (good[0] if good else None), bad

    def drop_newer(self, step: int) -> list[int]:
        """Invalidate the slots holding a step newer than ``step`` (a run rolled back to
        it: they are another trajectory's); returns those steps. The publisher's call."""
        self._take_lock()
        dropped = []
        for i in range(SLOTS):
            h = self.head(i)
            if h is not None and h.step > step:
                os.pwrite(self._open_slot(i), bytes(_HEAD.size), 0)  # as a torn slot
                dropped.append(h.step)
                if self._newest == i:
                    self._newest = None
        return dropped

    def forget(self) -> None:
        """Drop this store's mappings and what it knows of its slots (a slot is about to be
        written from outside: the peer replica's restore, ``ckpt/replica.py``)."""
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        self._newest = None

    def nbytes(self) -> int:
        """Bytes this rank's slots hold (what the tier costs in node memory)."""
        return sum(os.fstat(fd).st_size for fd in self._fds.values())

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._lock_fd is not None:
            close_lock_fd(self._lock_fd)
            self._lock_fd = None

    def remove(self) -> None:
        """Delete this rank's slots (a clean end of the job)."""
        for i in range(SLOTS):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.slot_path(i))


def _pack(step: int, gen: int, payload_len: int, digest: bytes, meta: bytes) -> bytes:
    fields = (MAGIC, VERSION, len(meta), step, gen, payload_len, digest)
    body = _HEAD.pack(*fields, 0)[:-8] + meta
    check = xxhash.xxh3_64_intdigest(body)
    return _HEAD.pack(*fields, check) + meta


def _read_head(fd: int, path: str, size: int) -> _Head:
    """The header of an open slot of ``size`` bytes, every field checked against the file
    before it is used."""
    if size < HEADER_BYTES:
        raise SlotDamaged(
            path, "torn", f"{size} bytes, shorter than the {HEADER_BYTES}-byte header"
        )
    raw = os.pread(fd, _HEAD.size, 0)
    if len(raw) != _HEAD.size:
        raise SlotDamaged(path, "torn", "short header")
    magic, version, meta_len, step, gen, payload_len, digest, check = _HEAD.unpack(raw)
    if magic != MAGIC:
        why = "being written or never completed" if magic == bytes(8) else "not a slot"
        raise SlotDamaged(path, "torn" if magic == bytes(8) else "bad-header", why)
    if version != VERSION:
        raise SlotDamaged(path, "bad-header", f"format version {version}, this reads {VERSION}")
    if meta_len > _MAX_META:
        raise SlotDamaged(path, "bad-header", f"meta length {meta_len} > {_MAX_META}")
    area = os.pread(fd, HEADER_BYTES - _HEAD.size, _HEAD.size)
    meta_raw = area[:meta_len]
    if xxhash.xxh3_64_intdigest(raw[:-8] + meta_raw) != check or len(meta_raw) != meta_len:
        raise SlotDamaged(path, "bad-header", "header checksum mismatch")
    if area.count(0, meta_len) != len(area) - meta_len:  # every byte of a slot is checked
        raise SlotDamaged(path, "bad-header", "bytes after the header's meta are not zero")
    if not (0 <= step < _MAX_STEP and 0 < gen < _MAX_STEP):
        raise SlotDamaged(path, "bad-header", f"step {step} / generation {gen} out of range")
    if payload_len != size - HEADER_BYTES:
        raise SlotDamaged(
            path, "torn", f"payload length {payload_len}, file holds {size - HEADER_BYTES}"
        )
    try:
        meta = json.loads(meta_raw)  # at most _MAX_META bytes
    except (ValueError, RecursionError) as e:
        raise SlotDamaged(path, "bad-header", f"meta is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise SlotDamaged(path, "bad-header", "meta is not an object")
    return _Head(step, gen, payload_len, digest, meta)


def _read_slot(fd: int, path: str) -> MemorySnapshot:
    size = os.fstat(fd).st_size
    head = _read_head(fd, path, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    payload = memoryview(mm)[HEADER_BYTES:]
    try:
        if payload_digest(payload) != head.digest:
            raise SlotDamaged(path, "checksum", "payload checksum mismatch (torn or bit rot)")
        if len(payload) < 8:
            raise SlotDamaged(path, "bad-payload", "no key table")
        (n,) = struct.unpack_from("<Q", payload, 0)
        if n > len(payload) - 8:
            raise SlotDamaged(path, "bad-payload", f"key table of {n} bytes > the payload")
        blob = load_json(bytes(payload[8 : 8 + n]), Budget(len(payload)), path)
        start = 8 + n
    finally:
        payload.release()
    if not isinstance(blob, dict) or not isinstance(blob.get("tensors"), dict):
        raise SlotDamaged(path, "bad-payload", "no tensor table")
    tensors: dict[str, torch.Tensor] = {}
    offset = start + _pad(start)
    for k, e in blob["tensors"].items():
        tensors[k], offset = _view(mm, k, e, offset, path)
    if offset != head.payload_len:
        raise SlotDamaged(
            path, "bad-payload", f"the table places {offset} bytes, the payload holds "
            f"{head.payload_len}"
        )  # fmt: skip
    rng = codec.decode(blob.get("rng"))
    tree = blob.get("state")
    _check(tree, rng, tensors, head.meta, path)
    return MemorySnapshot(path, head.step, head.generation, head.meta, tree, rng, tensors)


def _view(mm: mmap.mmap, key: Any, e: Any, offset: int, path: str) -> tuple[torch.Tensor, int]:
    """The tensor ``key`` of table entry ``e`` at ``offset`` of the payload (a read-only
    view of the mapping, after its dtype, shape and byte range are checked against the
    mapping), and the offset of the next one."""
    if not isinstance(e, dict) or not isinstance(key, str):
        raise SlotDamaged(path, "bad-payload", f"table entry {key!r} is not an object")
    shape = e.get("shape")
    dtype = torch_dtype(str(e.get("dtype")))  # the manifest's fixed list; ValueError otherwise
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(type(d) is int and 0 <= d < _MAX_STEP for d in shape)
    ):
        raise SlotDamaged(path, "bad-payload", f"table entry {key!r}: bad shape")
    nbytes = math.prod(shape) * dtype.itemsize
    if HEADER_BYTES + offset + nbytes > len(mm):
        raise SlotDamaged(
            path, "bad-payload", f"tensor {key!r}: bytes {offset}+{nbytes} outside the payload"
        )
    nxt = offset + nbytes + _pad(nbytes)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), nxt
    with warnings.catch_warnings():  # read-only on purpose: views never escape
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES + offset)
    return flat.view(dtype).view(shape), nxt


class _Refs(dict[str, torch.Tensor]):
    """The slot's tensors, recording which ones the state tree references."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.seen: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.seen.add(key)
        return super().__getitem__(key)


def _check(tree: Any, rng: Any, tensors: Mapping[str, torch.Tensor], meta: Any, path: str) -> None:
    """The state decodes, references exactly the slot's tensors and can be applied, checked
    as a disk restore checks a state file (:func:`~unbroken.ckpt.schema.check_state`)."""
    refs = _Refs(tensors)
    sd = codec.decode(tree, refs)
    layouts, generators = meta.get("layouts"), meta.get("generators")
    check_state(
        sd,
        rng,
        refs=refs.seen,
        stored=tensors,
        components=None,
        layouts=layouts if isinstance(layouts, dict) else None,
        generators=generators if isinstance(generators, dict) else None,
        counters=None,
        where=path,
    )


# --- the Checkpointer's side: publish a save's snapshot, restore the newest agreed step -----


class MemoryTier:
    """Publishes each snapshot of a :class:`~unbroken.ckpt.Checkpointer` into this rank's
    slots and restores from them (C-TIERS). ``root`` is the checkpoint root the slots
    belong to: a slot written for another root, world size or rank is never used.

    Restore is collective (:meth:`restore`): every rank lists the steps its slot headers
    claim; the ranks try the newest step they all hold that is not older than the disk
    tier's newest; each rank fully verifies its slot of that step, and only when every
    rank's verifies is it applied (through :meth:`.load.Loader.apply`, the disk tier's
    fit check, rehearsal and commit). Otherwise the next common step, then the disk tier.
    """

    def __init__(self, directory: str, root: str, comm: Comm) -> None:
        self.comm = comm
        self.root = os.path.realpath(root)
        self.store = SlotStore(directory, comm.rank)
        self.published: int | None = None  # newest step this process published (or began)
        self.disabled: str | None = None  # why publishing stopped (once, logged)
        self.older: int | None = None  # the last restore's newest common step, skipped as older
        self.held_any = False  # the last restore found a step, or a damaged slot, it did not use
        self.replica: Any = None  # the peer replica (ckpt/replica.py), set by the Checkpointer
        self.via_peer: int | None = None  # the step the last restore took from peer replicas
        self._finisher: ThreadPoolExecutor | None = None  # checksums and headers, off the loop
        self._finishing: Future[None] | None = None
        self.waits = 0  # publishes that waited for the previous one's checksum
        self.waited = 0.0  # seconds they waited
        self.planning = True  # publish from a plan when the state allows (ckpt/memplan.py)
        self.planned = 0  # publishes made from a plan
        self._plan: Plan | None = None
        self._replan_at = 0  # a plan refused: the full publish count at which to try again
        self._full = 0  # full publishes (a snapshot job)

    def _meta(self, state: TrainState, layouts: dict[str, Any]) -> dict[str, Any]:
        return {
            "root": self.root,
            "world": self.comm.world,
            "components": sorted(state.components),
            "layouts": layouts,
            "generators": schema.generators(state),
            "created": time.time(),
        }

    def publish(self, job: Job, state: TrainState, *, background: bool = False) -> None:
        """Publish ``job``'s snapshot (its tensors: the live ones, or the host copies an
        async disk save made). Not collective. The copy into the slot happens here; with
        ``background`` the checksum and header (what makes the slot complete) of a slot of
        at least :data:`BACKGROUND_BYTES` are left to this tier's own thread, so the caller
        pays for the copy alone (issue 25 speed item 3). A publish while the previous one is still being checksummed *waits* for it:
        skipping would silently lose more than K steps, which K=1 promises not to; the wait
        shows in the publish's stall, which ``unbroken plan`` turns into a larger K. A
        failure (tmpfs full) turns the tier off with one WARNING, never stops training."""
        if self.disabled is not None:
            return
        if any(isinstance(t, DTensor) for t in job.tensors.values()):
            self.disabled = (
                "the state holds sharded (DTensor) tensors, which the memory tier does not "
                "keep yet; the disk tier alone protects this job"
            )
            log.warning("memory tier off: %s", self.disabled)
            return
        meta = self._meta(state, schema.describe(state.components, job.sd["components"]))
        self.wait()
        try:
            pending = self.store.begin(job.step, job.tree, job.rng, job.tensors, meta)
        except OSError as e:
            self._off(job.step, e)
            return
        self._end_publish(pending, background)
        if background and self.planning:
            self._replan(state, job)

    def publish_planned(self, step: int, state: TrainState) -> bool:
        """Publish ``step`` from the plan the last full publish built (issue 25 item 2:
        ``ckpt/memplan.py``), as :meth:`publish` with ``background``. False when there is
        no plan or the state changed since (the caller then publishes a snapshot job)."""
        plan = self._plan
        if plan is None or self.disabled is not None:
            return False
        got = plan.render()
        if got is None:
            self._plan = None
            return False
        meta = self._meta(state, got.layouts)
        self.wait()
        try:
            pending = self.store.begin_rendered(
                step, got.state_json, got.rng, plan.sig, plan.srcs, meta
            )
        except OSError as e:
            self._off(step, e)
            return True
        self.planned += 1
        self._end_publish(pending, True)
        return True

    def _replan(self, state: TrainState, job: Job) -> None:
        """A plan from the full publish ``job``; a state a plan cannot follow is tried
        again 64 full publishes later (building one costs about a full publish's walk)."""
        self._full += 1
        if self._full < self._replan_at:
            return
        self._plan = Plan.build(state, job)
        if self._plan is None:
            self._replan_at = self._full + 64

    def _end_publish(self, pending: Pending, background: bool) -> None:
        """The copy is in the slot: complete it here (a small slot) or in the tier's
        thread."""
        self.published = pending.step
        if not background or pending.mapped.end < BACKGROUND_BYTES:
            self._finish(pending)  # hashing a small slot costs less than the hand-off
            return
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(1, thread_name_prefix="unbroken-memtier")
        self._finishing = self._finisher.submit(self._finish, pending, True)

    def drop_newer(self, step: int) -> None:
        """The slots of steps newer than ``step`` invalidated (:meth:`SlotStore.drop_newer`),
        and the peer replicas of them this rank keeps for others
        (:meth:`~unbroken.ckpt.replica.PeerReplica.drop_newer`), once the publish in flight
        is complete."""
        self.wait()
        try:
            dropped = self.store.drop_newer(step)
            if self.replica is not None:
                dropped += self.replica.drop_newer(step)
        except (OSError, TierBusy, PrivateDirError) as e:
            log.error(
                "memory tier: the copies of steps after %d (the run rolled back) could not be "
                "invalidated (%s); a restart may resume them: remove %s",
                step, e, self.store.directory,
            )  # fmt: skip
            return
        if dropped:
            log.info("memory tier: steps %s of the run rolled back invalidated", dropped)
        if self.published is not None and self.published > step:
            self.published = None

    def replicate(self, replica: Any) -> None:
        """Send every slot that becomes complete to ``replica`` (a ``PeerReplica``), from
        the thread that completed it; the receiver accepts only this job's root."""
        self.replica = replica
        replica.expect = {"root": self.root}
        self.store.on_complete = lambda path, step, generation: replica.offer(path)

    def _finish(self, pending: Pending, prepare: bool = False) -> None:
        try:
            self.store.finish(pending)
            if prepare:
                self.store.prepare(pending)
        except OSError as e:
            self._off(pending.step, e)

    def _off(self, step: int, e: OSError) -> None:
        self.disabled = str(e)
        log.warning(
            "memory tier off after a failed publish of step %d (%s); the disk tier "
            "alone protects this job from now on",
            step, e,
        )  # fmt: skip

    def wait(self) -> None:
        """Block until the publish in flight (if any) is complete."""
        fut = self._finishing
        if fut is None:
            return
        if not fut.done():
            t0 = time.perf_counter()
            fut.result()  # a Ctrl-C here leaves it in flight: the next publish waits too
            self.waits += 1
            self.waited += time.perf_counter() - t0
            if self.waits == 1:
                log.info(
                    "memory tier: a publish waited %.3f s for the previous one's checksum "
                    "(the checksum of a slot takes longer than K steps here)",
                    self.waited,
                )
        self._finishing = None  # finished: forgotten only now
        fut.result()

    def _mine(self) -> tuple[dict[int, int], list[str]]:
        """step -> slot, for the slots whose header verifies and that are this job's (the
        newer generation when both hold one step); and why each other slot that is there
        was not counted (damaged header, another job's)."""
        best: dict[int, tuple[int, int]] = {}
        why: list[str] = []
        me = {"root": self.root, "world": self.comm.world, "rank": self.comm.rank}
        for i in range(SLOTS):
            h = self.store.check_head(i)
            if isinstance(h, SlotDamaged):
                if h.reason != "torn":  # a publish cut short is no damage: the other slot is
                    why.append(
                        f"rank {self.comm.rank} slot-{i} is damaged ({h.reason}: {h.detail})"
                    )
                continue
            if h is None:
                continue
            other = [k for k, v in me.items() if h.meta.get(k) != v]
            if other:
                why.append(f"rank {self.comm.rank} slot-{i} is another job's ({other[0]} differs)")
                continue
            if h.step not in best or h.generation > best[h.step][0]:
                best[h.step] = (h.generation, i)
        return {s: i for s, (_, i) in best.items()}, why

    def restore(self, loader: Loader, disk_newest: int | None) -> tuple[int | None, str]:
        """Apply the newest step every rank holds in memory, when it is not older than
        ``disk_newest``. Returns (the step applied or None, why a newer copy was skipped
        or why memory was not used). Collective."""
        self.older = self.via_peer = None
        self.held_any = False
        self.wait()
        local: list[str] = []
        try:  # a live publisher (a worker not yet stopped) could rewrite a slot under us
            self.store._take_lock()
            mine, local = self._mine()
        except TierBusy as e:
            mine = {}
            local.append(str(e))
        if self.replica is not None:  # a lost node's ranks get their replicas (collective)
            ok = self.store._lock_fd is not None
            self.via_peer, peer = self.replica.fill(
                self.comm, self.store, sorted(mine), disk_newest, ok
            )
            local += peer if self.comm.rank == 0 else []
            if self.via_peer is not None:
                mine, _ = self._mine()
        gathered = self.comm.gather((sorted(mine), local))
        held = [h for h, _ in gathered]
        notes = [n for _, ns in gathered for n in ns][:8]  # bounded: one line for a big job
        common = set(held[0]).intersection(*held[1:]) if held else set()
        newest_any = max((s for h in held for s in h), default=None)
        if newest_any is not None and newest_any not in common:
            lacking = [r for r, h in enumerate(held) if newest_any not in h]
            notes.append(f"memory step {newest_any} is missing on rank(s) {lacking[:8]}")
        for s in sorted(common, reverse=True):
            if disk_newest is not None and s < disk_newest:
                notes.append(f"memory step {s} is older than disk step {disk_newest}")
                self.older = s
                break
            why = self._try(loader, s, mine[s])
            if why is None:
                return s, "; ".join(notes)
            notes.append(f"memory step {s} is damaged: {why}")
        self.held_any = newest_any is not None or bool(notes)
        if newest_any is None:
            notes.append("the memory tier is missing: it holds no step of this job")
        return None, "; ".join(notes)

    def _try(self, loader: Loader, s: int, slot: int) -> str | None:
        why: str | None = None
        snap: MemorySnapshot | None = None
        try:
            snap = self.store.read(slot)
            if snap.step != s:
                why = f"slot-{slot} changed under us (step {snap.step})"
        except SlotDamaged as e:
            why = f"{os.path.basename(e.path)} {e.reason}: {e.detail}"
        verdicts = self.comm.gather(why)
        bad = [(r, w) for r, w in enumerate(verdicts) if w]
        if bad or snap is None:
            r, w = bad[0] if bad else (self.comm.rank, "not read")
            return f"rank {r}: {w}"
        try:
            got = loader.apply(_as_verified(snap, self.comm.world))
        except ValueError as e:  # does not fit the live state: the disk tier will say why
            got = NotLoaded(str(e).splitlines()[0], refused=True)
        finally:
            del snap  # the views of the mapping go with it
        return None if got is None else got.text

    def close(self, disk_newest: int | None, *, crashed: bool = False) -> None:
        """End of the job: the slots are removed when the disk tier holds everything they
        hold (nothing to lose), else kept for a resume and their place logged; kept in a
        directory the node's agent removes when the job ends (``unbroken run``: a worker
        cannot tell a loop that caught a failure and exited 1 from a clean end). ``crashed``
        (the process ends on an unhandled exception, e.g. a collective failed with a lost
        peer): kept whatever the disk holds, as a SIGKILL leaves them: the restart restores
        from memory, and the replica this rank keeps may be a lost node's only copy in
        memory."""
        try:
            self.wait()
        finally:
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None
            if self.replica is not None:  # after the last completion: its round is offered
                self.replica.close()
            self.store.close()
        if crashed:
            log.info(
                "memory tier kept at %s for the restart: the process ends on an unhandled "
                "exception (this process published step %s; the disk tier's newest: %s)",
                self.store.rank_dir, self.published, disk_newest,
            )  # fmt: skip
            return
        if memdir.agent_removes(self.store.directory):
            log.info(
                "memory tier kept at %s: the node's agent removes it when the job ends",
                self.store.rank_dir,
            )
            return
        if self.published is not None and (disk_newest is None or disk_newest < self.published):
            log.info(
                "memory tier kept at %s: it holds step %d, newer than the disk tier's %s",
                self.store.rank_dir, self.published, disk_newest,
            )  # fmt: skip
            return
        log.info(
            "memory tier removed from %s: the disk tier holds step %s, this process published "
            "%s (a clean end)", self.store.rank_dir, disk_newest, self.published,
        )  # fmt: skip
        self.store.remove()
        if self.replica is not None:
            self.replica.remove()
        with contextlib.suppress(OSError):  # the job directory stays while other ranks use it
            os.unlink(os.path.join(self.store.rank_dir, "lock"))
            os.rmdir(self.store.rank_dir)
            os.rmdir(self.store.directory)


def _as_verified(snap: MemorySnapshot, world: int) -> Verified:
    """A verified slot in the shape the disk tier's loader applies: every tensor whole
    (``views``), saved by this rank at this world size."""
    tensors = {
        k: TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape), False, None, ())
        for k, t in snap.tensors.items()
    }
    tree = snap.tree if isinstance(snap.tree, dict) else {}
    manifest = CheckpointManifest(
        step=snap.step,
        world_size=world,
        ranks={},
        files={},
        tensors=tensors,
        counters=dict(tree.get("counters", {})),
        created=created if isinstance(created := snap.meta.get("created"), float) else None,
    )
    needed = frozenset(codec.tensor_keys(snap.tree))
    return Verified(snap.step, manifest, snap.tree, snap.tensors, snap.rng, needed)
