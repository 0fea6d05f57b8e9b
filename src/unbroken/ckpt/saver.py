"""Tensor I/O in the ``torch.distributed.checkpoint`` file format, with inline checksums.

Writing goes through ``dcp.save`` with a storage writer whose streams hash every byte as it
is written (no second read), and a planner that hands DCP compact tensors so every item's
storage is exactly its bytes. The resulting directory is an ordinary DCP checkpoint:
``dcp.load`` and DCP's tools read it.

Reading has two paths:
* the fast path (:func:`read_tensors`) walks each ``.distcp`` file once, sequentially,
  hashing every byte and reading each tensor's storage record straight into a fresh
  tensor (one copy from the page cache, no ``torch.load`` per item, no pickle);
* anything unusual in an item (a foreign layout) falls back to ``torch.load(weights_only=True)``
  of that item's bytes. DCP's ``.metadata`` pickle is never unpickled on the fast path:
  item locations come from our JSON manifest.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import struct
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem

from unbroken._fs import HashingWriter, hasher

__all__ = ["ChecksumError", "ItemLocation", "read_tensors", "tensor_stats", "write_tensors"]


class ChecksumError(RuntimeError):
    """A file's bytes do not match the checksum recorded when it was written."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class ItemLocation:
    """Where DCP put one tensor (or one chunk of a sharded tensor)."""

    key: str
    chunk_offsets: tuple[int, ...]
    file: str
    offset: int
    length: int


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem, but every written stream records its size and checksum."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, tuple[int, str]] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as s:
                yield s
            return
        # DCP fsyncs data files itself (sync_files=True); we fsync the directory at commit.
        w = HashingWriter(str(path), fsync=False)
        try:
            yield w
        except BaseException as e:
            # DCP's extra writer threads drop exceptions, and its main thread wraps them in a
            # CheckpointException: keep the original so the caller can see e.g. ENOSPC.
            with self._lock:
                self.errors.append(e)
            raise
        finally:
            w.close()
            with self._lock:
                self.written[os.path.basename(str(path))] = (w.size, w.digest)


class _Writer(FileSystemWriter):
    def __init__(self, path: str, thread_count: int) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=thread_count
        )
        self.fs: _HashingFileSystem = _HashingFileSystem()
        self.locations: list[ItemLocation] = []

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        super().finish(metadata, results)
        for wr_list in results:
            for wr in wr_list:
                sd = wr.storage_data
                off = tuple(int(x) for x in (wr.index.offset or ()))
                self.locations.append(
                    ItemLocation(
                        wr.index.fqn, off, sd.relative_path, int(sd.offset), int(sd.length)
                    )
                )


class _CompactPlanner(DefaultSavePlanner):
    """Hands DCP tensors whose storage is exactly their bytes (views and strided tensors are
    compacted), so a reader can take the storage record as the tensor's data."""

    def resolve_data(self, write_item: Any) -> Any:
        obj = super().resolve_data(write_item)
        if isinstance(obj, torch.Tensor):
            obj = obj.detach()
            if (
                not obj.is_contiguous()
                or obj.storage_offset() != 0
                or obj.untyped_storage().nbytes() != obj.numel() * obj.element_size()
            ):
                obj = obj.clone(memory_format=torch.contiguous_format)
        return obj


def tensor_stats(t: torch.Tensor) -> dict[str, float] | None:
    """Sum and L2 norm: a semantic check of restored values beyond the byte checksum.

    Reduced in float32 for floating tensors (float64 reductions cost ~15x more on CPU and
    this runs on every save); :func:`stats_match` allows for reduction-order rounding.
    """
    if t.is_complex() or t.numel() == 0:
        return None
    t = t.detach()
    if t.is_floating_point():
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        return {
            "sum": float(torch.sum(t, dtype=acc)),
            "norm": float(torch.linalg.vector_norm(t, dtype=acc)),
        }
    t = t.to(torch.float64)  # integer and bool state is small (counters, masks)
    return {"sum": float(t.sum()), "norm": float(torch.linalg.vector_norm(t))}


def _close(a: float, b: float, tol: float) -> bool:
    if math.isnan(a) or math.isnan(b):  # a tensor may legitimately hold NaN/inf
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol


def stats_match(expected: Mapping[str, float] | None, t: torch.Tensor) -> bool:
    got = tensor_stats(t)
    if expected is None or got is None:
        return expected is None and got is None
    norm = expected["norm"]
    if not _close(got["norm"], norm, 1e-5 * abs(norm) + 1e-30):
        return False
    # |sum| <= sqrt(n) * norm bounds the reduction-order rounding of the sum.
    tol = 1e-5 * (t.numel() ** 0.5) * abs(norm) if math.isfinite(norm) else 0.0
    return _close(got["sum"], expected["sum"], tol + 1e-30)


def _first_cause(errors: list[BaseException]) -> BaseException:
    """The OSError (e.g. ENOSPC) behind torch's wrapping RuntimeErrors, else the first error."""
    for e in errors:
        seen: BaseException | None = e
        while seen is not None:
            if isinstance(seen, OSError):
                return seen
            seen = seen.__cause__ or seen.__context__
    return errors[0]


def write_tensors(
    directory: str, tensors: Mapping[str, torch.Tensor], *, threads: int = 2
) -> tuple[dict[str, tuple[int, str]], list[ItemLocation], dict[str, Any]]:
    """Write ``tensors`` as a DCP checkpoint into ``directory``.

    Returns ``(files, locations, stats)``: ``{file: (size, checksum)}`` of everything written,
    where each item landed, and per-tensor shape/dtype/sum/norm (computed alongside the write).
    """
    writer = _Writer(directory, thread_count=max(1, threads))
    with ThreadPoolExecutor(1) as pool:  # torch reductions release the GIL: overlap with I/O
        fut = pool.submit(
            lambda: {
                k: {
                    "dtype": str(v.dtype).removeprefix("torch."),
                    "shape": list(v.shape),
                    "stats": tensor_stats(v),
                }
                for k, v in tensors.items()
            }
        )
        with warnings.catch_warnings():  # single-process use is intended, not an accident
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.save(dict(tensors), storage_writer=writer, planner=_CompactPlanner())
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if writer.fs.errors:
                    raise _first_cause(writer.fs.errors) from e
                raise
        stats = fut.result()
    if writer.fs.errors:
        raise _first_cause(writer.fs.errors)
    missing = set(tensors) - {loc.key for loc in writer.locations}
    if missing:  # a silently dead writer thread: never commit an incomplete checkpoint
        raise RuntimeError(f"DCP wrote no data for {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return dict(writer.fs.written), writer.locations, stats


# --- reading ---------------------------------------------------------------------------------

_LOCAL = b"PK\x03\x04"


class _Fallback(Exception):
    pass


class _HashedFile:
    """Sequential reader that hashes every byte it hands out."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
        self.h = hasher()
        self.pos = 0

    def into(self, mv: memoryview) -> None:
        n = 0
        while n < len(mv):
            k = self.f.readinto(mv[n:])
            if not k:
                raise ChecksumError(self.path, f"truncated: ended at byte {self.pos + n}")
            n += k
        self.h.update(mv)
        self.pos += n

    def take(self, n: int) -> bytes:
        buf = bytearray(n)
        self.into(memoryview(buf))
        return bytes(buf)


def _read_item(
    f: _HashedFile, end: int, dtype: torch.dtype, shape: list[int]
) -> torch.Tensor | None:
    """Consume one torch.save blob ending at ``end``; return its tensor, or None if the
    layout is not the compact one we write (caller falls back to torch.load)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    tensor: torch.Tensor | None = None
    ok = True
    while f.pos < end:
        hdr = f.take(min(30, end - f.pos))
        if hdr[:4] != _LOCAL or len(hdr) < 30:
            f.take(end - f.pos)  # central directory and end records
            break
        flags, method = struct.unpack_from("<HH", hdr, 6)
        csize, _usize, nlen, xlen = struct.unpack_from("<IIHH", hdr, 18)
        name = f.take(nlen)
        extra = f.take(xlen)
        if csize == 0xFFFFFFFF:  # zip64: sizes live in the extra field (id 0x0001)
            i = 0
            while i + 4 <= len(extra):
                hid, hlen = struct.unpack_from("<HH", extra, i)
                if hid == 1:
                    _u64, csize = struct.unpack_from("<QQ", extra, i + 4)
                    break
                i += 4 + hlen
        if flags & 8 or method != 0:
            ok = False
            f.take(end - f.pos)
            break
        if name.endswith(b"/data/0") and tensor is None and csize == nbytes:
            tensor = torch.empty(shape, dtype=dtype)
            if nbytes:
                f.into(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        else:
            data = f.take(csize)
            if name.endswith(b"/byteorder") and data != sys.byteorder.encode():
                ok = False
            elif b"/data/" in name:
                ok = False  # several storages or an unexpected size: not our compact layout
    return tensor if ok else None


def read_tensors(
    directory: str,
    files: Mapping[str, Mapping[str, Any]],
    locations: list[ItemLocation],
    meta: Mapping[str, Mapping[str, Any]],
) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint we wrote, verifying each data file's checksum.

    ``files``: ``{name: {"size", "checksum"}}``; ``meta``: ``{key: {"dtype", "shape"}}``.
    Raises :class:`ChecksumError` on any mismatch. Only whole (unsharded) tensors are read
    here; sharded checkpoints load through ``dcp.load``.
    """
    by_file: dict[str, list[ItemLocation]] = {}
    for loc in locations:
        by_file.setdefault(loc.file, []).append(loc)
    out: dict[str, torch.Tensor] = {}

    def one(name: str) -> dict[str, torch.Tensor]:
        path = os.path.join(directory, name)
        want = files.get(name)
        if want is None:
            raise ChecksumError(path, "data file is not listed in the manifest")
        if not os.path.exists(path):
            raise ChecksumError(path, "missing file")
        size = os.path.getsize(path)
        if size != want["size"]:
            raise ChecksumError(path, f"size {size} != {want['size']} recorded in the manifest")
        got: dict[str, torch.Tensor] = {}
        fallback: list[ItemLocation] = []
        f = _HashedFile(path)
        try:
            for loc in sorted(by_file[name], key=lambda x: x.offset):
                if loc.offset > f.pos:
                    f.take(loc.offset - f.pos)
                m = meta[loc.key]
                dtype = getattr(torch, m["dtype"])
                t = _read_item(f, loc.offset + loc.length, dtype, m["shape"])
                if t is None:
                    fallback.append(loc)
                else:
                    got[loc.key] = t
            if f.pos < size:
                f.take(size - f.pos)
        finally:
            f.f.close()
        if f.h.hexdigest() != want["checksum"]:
            raise ChecksumError(path, "checksum mismatch (bit rot or a torn write)")
        for loc in fallback:
            with open(path, "rb") as fh:
                fh.seek(loc.offset)
                blob = fh.read(loc.length)
            got[loc.key] = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        return got

    names = sorted(by_file)
    with ThreadPoolExecutor(max(1, min(len(names), 4))) as pool:
        for part in pool.map(one, names):
            out.update(part)
    return out
