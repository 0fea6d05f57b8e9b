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

import collections
import contextlib
import errno
import fcntl
import json
import logging
import math
import mmap
import os
import struct
import warnings
from collections.abc import Mapping
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
from unbroken.ckpt.save import Job
from unbroken.ckpt.schema import check_state
from unbroken.ckpt.state import TrainState
from unbroken.ckpt.verify import Verified
from unbroken.common.fs import PrivateDirError, hasher, open_private, private_dir

__all__ = [
    "ENV",
    "HEADER_BYTES",
    "MemorySnapshot",
    "MemoryTier",
    "SlotDamaged",
    "SlotStore",
    "TierBusy",
    "default_dir",
]

log = logging.getLogger(__name__)

ENV = "UNBROKEN_MEMORY_TIER"
"""Environment variable naming the job's memory-tier directory (set by ``unbroken run``)."""

MAGIC = b"UBSLOT\r\n"
VERSION = 1
# magic, version, meta length, step, generation, payload length, payload xxh3-128, header xxh3-64
_HEAD = struct.Struct("<8sIIqqQ16sQ")
HEADER_BYTES = 64 << 10
"""Bytes reserved at the start of a slot for the header and its meta JSON."""
_MAX_META = HEADER_BYTES - _HEAD.size
_ALIGN = 64
_MAX_DIMS = 64
_MAX_STEP = 1 << 62
SLOTS = 2


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
    job = xxhash.xxh3_64_hexdigest(os.path.realpath(root).encode())
    return os.path.join("/dev/shm", f"unbroken-{os.geteuid()}", job)


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


def _slot_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


def _pad(n: int) -> int:
    return -n % _ALIGN


_IOV_MAX = 1024  # buffers per pwritev call (Linux allows 1024)
_ZEROS = memoryview(bytes(_ALIGN))


def _pwritev_all(fd: int, bufs: list[memoryview | bytes], offset: int) -> int:
    """Write ``bufs`` in order at ``offset`` with few system calls (a small state is one
    ``pwritev``); short writes are resumed. Returns the offset after the last byte."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    i = 0
    while i < len(views):
        n = os.pwritev(fd, views[i : i + _IOV_MAX], offset)
        offset += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
    return offset


class SlotStore:
    """The two slots of one rank under ``directory`` (see the module docstring).

    ``directory`` (the job's) and its ``rank-<r>`` subdirectory are created private or
    refused with :class:`~unbroken.common.fs.PrivateDirError`. The first :meth:`publish`
    takes the rank directory's lock (a second live publisher is refused with
    :class:`TierBusy`); :meth:`close` releases it.
    """

    def __init__(self, directory: str, rank: int) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r} must be a non-negative integer")
        self.directory = directory
        self.rank = rank
        parent = os.path.dirname(os.path.abspath(directory))
        if os.path.basename(parent).startswith("unbroken-"):  # the default layout's user dir
            private_dir(parent, purpose="memory-tier directory")
        private_dir(directory, purpose="memory-tier directory")
        self.rank_dir = private_dir(
            os.path.join(directory, f"rank-{rank}"), purpose="memory-tier rank directory"
        )
        self._lock_fd: int | None = None
        self._fds: dict[int, int] = {}  # slot -> fd, opened once by the publisher
        self._newest: int | None = None  # the slot holding the newest verified step
        self._generation = 0

    def slot_path(self, i: int) -> str:
        return os.path.join(self.rank_dir, f"slot-{i}")

    # --- publishing -------------------------------------------------------------------------

    def _take_lock(self) -> None:
        if self._lock_fd is not None:
            return
        path = os.path.join(self.rank_dir, "lock")
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
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
        (tensor references in ``tree`` name keys of ``tensors``); ``tensors`` are CPU
        tensors (made contiguous here when they are not). Returns the slot's path."""
        if not isinstance(step, int) or not 0 <= step < _MAX_STEP:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        self._take_lock()
        i = self._target()
        path = self.slot_path(i)
        meta_raw = json.dumps({**(meta or {}), "rank": self.rank}).encode()
        if len(meta_raw) > _MAX_META:
            raise ValueError(f"memory-tier meta of {len(meta_raw)} bytes exceeds {_MAX_META}")
        parts, end = self._layout(tree, rng, tensors)
        fd = self._open_slot(i)
        _pwritev_all(fd, [bytes(_HEAD.size)], 0)  # invalidate first: a torn slot never verifies
        if os.fstat(fd).st_size != HEADER_BYTES + end:
            os.ftruncate(fd, HEADER_BYTES + end)
        h = hasher()
        collections.deque(map(h.update, parts), maxlen=0)  # hash without a Python loop
        _pwritev_all(fd, parts, HEADER_BYTES)
        gen = self._generation + 1
        _pwritev_all(fd, [_pack(step, gen, end, h.digest(), meta_raw)], 0)
        self._newest, self._generation = i, gen
        return path

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

    @staticmethod
    def _layout(
        tree: Any, rng: Any, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[list[memoryview | bytes], int]:
        """The payload as buffers in order (no joining copy) and its length. The tensors
        follow the key table in its order, each at the next 64-byte boundary: offsets are
        implied by the table, never stored (one less field to trust, one JSON encode)."""
        flat = {k: t.detach().contiguous() for k, t in tensors.items()}  # no copy when already
        table = {
            k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for k, t in flat.items()
        }
        blob = json.dumps({"state": tree, "rng": rng, "tensors": table}).encode()
        head = struct.pack("<Q", len(blob)) + blob
        head += bytes(_pad(len(head)))
        parts: list[memoryview | bytes] = [head]
        end = len(head)
        for t in flat.values():
            raw = _slot_bytes(t)
            parts.append(raw)
            end += len(raw)
            if _pad(len(raw)):
                parts.append(_ZEROS[: _pad(len(raw))])
                end += _pad(len(raw))
        return parts, end

    # --- reading ----------------------------------------------------------------------------

    def head(self, i: int) -> _Head | None:
        """Slot ``i``'s header when it verifies (the payload is not read), else None."""
        try:
            fd = open_private(self.slot_path(i), os.O_RDONLY | os.O_NONBLOCK)
        except (OSError, PrivateDirError):
            return None
        try:
            return _read_head(fd, self.slot_path(i), os.fstat(fd).st_size)
        except SlotDamaged:
            return None
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

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
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
        if xxhash.xxh3_128_digest(payload) != head.digest:
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
        self.published: int | None = None  # newest step this process published
        self.disabled: str | None = None  # why publishing stopped (once, logged)
        self.inline: bool | None = None  # publish in the loop (a small state); None: not known yet

    def _meta(self, job: Job, state: TrainState) -> dict[str, Any]:
        return {
            "root": self.root,
            "world": self.comm.world,
            "components": sorted(state.components),
            "layouts": schema.describe(state.components, job.sd["components"]),
            "generators": schema.generators(state),
        }

    def publish(self, job: Job, state: TrainState) -> None:
        """Publish ``job``'s snapshot (its tensors are the host copies the loop already
        made, or the live tensors in a synchronous save). Not collective."""
        if self.disabled is not None:
            return
        if any(isinstance(t, DTensor) for t in job.tensors.values()):
            self.disabled = (
                "the state holds sharded (DTensor) tensors, which the memory tier does not "
                "keep yet; the disk tier alone protects this job"
            )
            log.warning("memory tier off: %s", self.disabled)
            return
        self.store.publish(job.step, job.tree, job.rng, job.tensors, self._meta(job, state))
        self.published = job.step

    def _mine(self) -> dict[int, int]:
        """step -> slot, for the slots whose header verifies and that are this job's (the
        newer generation when both hold one step)."""
        best: dict[int, tuple[int, int]] = {}
        me = {"root": self.root, "world": self.comm.world, "rank": self.comm.rank}
        for i in range(SLOTS):
            h = self.store.head(i)
            if h is None or any(h.meta.get(k) != v for k, v in me.items()):
                continue
            if h.step not in best or h.generation > best[h.step][0]:
                best[h.step] = (h.generation, i)
        return {s: i for s, (_, i) in best.items()}

    def restore(self, loader: Loader, disk_newest: int | None) -> tuple[int | None, str]:
        """Apply the newest step every rank holds in memory, when it is not older than
        ``disk_newest``. Returns (the step applied or None, why a newer copy was skipped
        or why memory was not used). Collective."""
        notes: list[str] = []
        try:  # a live publisher (a worker not yet stopped) could rewrite a slot under us
            self.store._take_lock()
            mine = self._mine()
        except TierBusy as e:
            mine = {}
            notes.append(str(e))
        held = self.comm.gather(sorted(mine))
        common = set(held[0]).intersection(*held[1:]) if held else set()
        newest_any = max((s for h in held for s in h), default=None)
        if newest_any is not None and newest_any not in common:
            lacking = [r for r, h in enumerate(held) if newest_any not in h]
            notes.append(f"memory step {newest_any} is missing on rank(s) {lacking[:8]}")
        for s in sorted(common, reverse=True):
            if disk_newest is not None and s < disk_newest:
                notes.append(f"memory step {s} is older than disk step {disk_newest}")
                break
            why = self._try(loader, s, mine[s])
            if why is None:
                return s, "; ".join(notes)
            notes.append(f"memory step {s}: {why}")
        if newest_any is None:
            notes.append("the memory tier holds no step of this job")
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

    def close(self, disk_newest: int | None) -> None:
        """End of the job: the slots are removed when the disk tier holds everything they
        hold (nothing to lose), else kept for a resume and their place logged."""
        self.store.close()
        if self.published is not None and (disk_newest is None or disk_newest < self.published):
            log.info(
                "memory tier kept at %s: it holds step %d, newer than the disk tier's %s",
                self.store.rank_dir, self.published, disk_newest,
            )  # fmt: skip
            return
        self.store.remove()
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
    )
    needed = frozenset(codec.tensor_keys(snap.tree))
    return Verified(snap.step, manifest, snap.tree, snap.tensors, snap.rng, needed)
