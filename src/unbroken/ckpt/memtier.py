"""The memory tier: the loop's snapshot kept in node memory that outlives the worker
(issue 25, C-TIERS; design in ARCHITECTURE.md "The memory tier").

Each rank owns two slot files in a private directory on tmpfs
(``/dev/shm/unbroken-<uid>/<job>/rank-<r>/slot-{0,1}``). A slot is::

    [header: _HEAD struct + meta JSON, padded to HEADER_BYTES][payload]
    payload = [u64 n][n bytes of JSON: state tree, rng, tensor key table][pad][tensor bytes]

The state tree and RNG are the disk tier's codec encoding (:mod:`.codec`: JSON, no
pickle); the tensors are raw bytes placed by the key table, each 64-byte aligned.
:meth:`SlotStore.publish` writes into the slot that does *not* hold the newest complete
step: its header is zeroed first, then the payload, then the header last (generation,
step, payload length, xxh3-128 of the payload, header checksum). :meth:`SlotStore.newest`
returns the verified slot of highest generation: the slot in flight never hides the last
complete one, and a torn or damaged slot falls back to the other, then to none.

Every byte of a slot is untrusted (T-BOUNDED, T-FALL-BACK): lengths are checked against
the file's size before anything is read, the JSON is charged to a budget of the payload's
size (:mod:`.bounds`), dtypes come from the manifest's fixed list, shapes and offsets must
match the bytes, the state is checked as a disk restore would (:func:`.schema.check_state`).
Any failure is a :class:`SlotDamaged` reason, never an exception out of :meth:`newest`.

The directory is private (T-SHARED-NODE, :func:`~unbroken.common.fs.private_dir`): owned
by this user, not writable by group or others, no symlink; slots are opened with
``O_NOFOLLOW`` and mode 0600; one live publisher per rank directory (``flock``).
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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from unbroken.ckpt import codec
from unbroken.ckpt.bounds import Budget, load_json
from unbroken.ckpt.manifest import torch_dtype
from unbroken.ckpt.schema import check_state
from unbroken.common.fs import PrivateDirError, hasher, open_private, private_dir

__all__ = [
    "ENV",
    "HEADER_BYTES",
    "MemorySnapshot",
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
    arr: Any = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


def _pad(n: int) -> int:
    return -n % _ALIGN


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> int:
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):  # pwrite may write less than asked
        done += os.pwrite(fd, mv[done:], offset + done)
    return offset + done


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
                    (h.generation for h in map(self._head_or_none, range(SLOTS)) if h), default=0
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
        parts, table, end = self._layout(tree, rng, tensors)
        fd = self._open_slot(path)
        try:
            os.pwrite(fd, bytes(_HEAD.size), 0)  # invalidate first: a torn slot never verifies
            if os.fstat(fd).st_size != HEADER_BYTES + end:
                os.ftruncate(fd, HEADER_BYTES + end)
            h = hasher()
            offset = HEADER_BYTES
            for part in parts:
                h.update(part)
                offset = _pwrite_all(fd, part, offset)
            gen = self._generation + 1
            _pwrite_all(fd, _pack(step, gen, end, h.digest(), meta_raw), 0)
        finally:
            os.close(fd)
        self._newest, self._generation = i, gen
        return path

    def _open_slot(self, path: str) -> int:
        try:
            return open_private(path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise PrivateDirError(
                    f"{path}: a symlink in place of a memory-tier slot; remove it"
                ) from None
            raise

    @staticmethod
    def _layout(
        tree: Any, rng: Any, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[list[memoryview | bytes], dict[str, Any], int]:
        """The payload as buffers in order (no joining copy), its key table and length."""
        flat = {k: t.detach().contiguous() for k, t in tensors.items()}
        table: dict[str, Any] = {}
        # the table's offsets depend on the JSON's length: place tensors after a bound on it
        sizes = {k: t.numel() * t.element_size() for k, t in flat.items()}
        draft = {
            k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for k, t in flat.items()
        }
        body = json.dumps({"state": tree, "rng": rng, "tensors": draft}).encode()
        offset = 8 + len(body) + 24 * len(flat) + 64  # room for each "offset": <= 20 digits
        offset += _pad(offset)
        for k in flat:
            table[k] = {**draft[k], "offset": offset}
            offset += sizes[k] + _pad(sizes[k])
        blob = json.dumps({"state": tree, "rng": rng, "tensors": table}).encode()
        first = next(iter(table.values()), {"offset": offset})["offset"]
        if 8 + len(blob) > first:  # unreachable by the bound above; never overlap bytes
            raise RuntimeError("memory-tier key table outgrew its room")
        head = struct.pack("<Q", len(blob)) + blob + bytes(first - 8 - len(blob))
        parts: list[memoryview | bytes] = [head]
        for k, t in flat.items():
            parts.append(_slot_bytes(t))
            if _pad(sizes[k]):
                parts.append(bytes(_pad(sizes[k])))
        return parts, table, offset

    # --- reading ----------------------------------------------------------------------------

    def _head_or_none(self, i: int) -> _Head | None:
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
        except BaseException as e:  # noqa: BLE001 - any fault of untrusted bytes is damage
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
    tensors = {
        k: _view(mm, k, e, start, head.payload_len, path) for k, e in blob["tensors"].items()
    }
    rng = codec.decode(blob.get("rng"))
    tree = blob.get("state")
    _check(tree, rng, tensors, head.meta, path)
    return MemorySnapshot(path, head.step, head.generation, head.meta, tree, rng, tensors)


def _view(mm: mmap.mmap, key: Any, e: Any, start: int, payload_len: int, path: str) -> torch.Tensor:
    """The tensor ``key`` of the table entry ``e``: a read-only view of the mapping, after
    its dtype, shape and byte range are checked against the payload."""
    if not isinstance(e, dict) or not isinstance(key, str):
        raise SlotDamaged(path, "bad-payload", f"table entry {key!r} is not an object")
    shape, offset = e.get("shape"), e.get("offset")
    dtype = torch_dtype(str(e.get("dtype")))  # the manifest's fixed list; ValueError otherwise
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(type(d) is int and 0 <= d < _MAX_STEP for d in shape)
        or type(offset) is not int
    ):
        raise SlotDamaged(path, "bad-payload", f"table entry {key!r}: bad shape or offset")
    nbytes = math.prod(shape) * dtype.itemsize
    if offset < start or offset % _ALIGN or offset + nbytes > payload_len:
        raise SlotDamaged(
            path, "bad-payload", f"tensor {key!r}: bytes {offset}+{nbytes} outside the payload"
        )
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only on purpose: views never escape
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES + offset)
    return flat.view(dtype).view(shape)


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
