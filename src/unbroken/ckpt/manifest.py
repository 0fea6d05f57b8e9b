"""``manifest.json``: the one typed description of a committed checkpoint, validated once.

On disk (written last by the commit, so a step directory counts only once it is complete)::

    {
      "format": "unbroken-checkpoint", "version": 2, "step": 500,
      "created": 1718000000.0, "world_size": 2,
      "ranks": {"0": {"state": "state-rank0.json"}, "1": {"state": "state-rank1.json"}},
      "unbroken_version": "0.1.0", "torch_version": "2.13.0", "checksum_algo": "xxh3_128",
      "files": {"__0_0.distcp": {"size": 2600, "checksum": "<32 hex digits>"},
                ".metadata": {...}, "state-rank0.json": {...}},
      "tensors": {
        "components/model/0.weight": {
          "dtype": "float32", "shape": [32, 16], "sharded": false,
          "stats": {"sum": 1.5, "norm": 4.2},          # null for sharded tensors
          "chunks": [{"offsets": [0, 0], "sizes": [32, 16],
                      "file": "__0_0.distcp", "offset": 0, "length": 2600}]}},
      "counters": {"step": 500, "samples": 16000, "tokens": 0, "micro_step": 0},
      "data_state": {...} | null,                       # the loader's state, for humans
      "save_seconds": 1.2, "blocked_seconds": 0.2,
      "manifest_checksum": "<xxh3-128 of the canonical JSON of every other field>"
    }

Every file of a checkpoint is untrusted input (bit rot, truncation, a crafted copy), so
:meth:`CheckpointManifest.from_json` checks everything before any other file is opened:
types, dtypes from a fixed set, shapes, chunks inside their tensor and covering it, byte
ranges inside their file's recorded size, rank state files listed, every file name a plain
name inside the step directory (no ``/``, no ``..``, not absolute), the step number, and
(version 2) the manifest's own checksum, so a flipped bit in any field is caught even when
the JSON still parses. :meth:`CheckpointManifest.check_files` then checks the directory:
every listed file a regular file (not a symlink) of its recorded size.

Version 1 (written before chunk sizes and the self-checksum) is still read.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from unbroken._fs import CHECKSUM_ALGO, checksum_bytes

__all__ = [
    "DTYPES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "METADATA",
    "Chunk",
    "CheckpointManifest",
    "FileEntry",
    "ManifestError",
    "TensorEntry",
    "manifest_digest",
    "torch_dtype",
]

FORMAT = "unbroken-checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's own metadata (a pickle): checked, never unpickled by us
DTYPES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "complex128", "complex64",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
)  # fmt: skip
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_HEX32_RE = re.compile(r"^[0-9a-f]{32}$")
_CHECKSUM_KEY = "manifest_checksum"
_KNOWN = frozenset(
    {
        "format", "version", "step", "created", "world_size", "ranks", "unbroken_version",
        "torch_version", "checksum_algo", "files", "tensors", "counters", "data_state",
        "save_seconds", "blocked_seconds", _CHECKSUM_KEY,
    }
)  # fmt: skip


class ManifestError(ValueError):
    """A manifest (or a file it lists) that cannot be trusted; ``reason`` is a short slug
    (``bad-manifest``, ``missing-file``, ``size``, ``symlink``) used in quarantine names."""

    def __init__(self, where: str, detail: str, reason: str = "bad-manifest") -> None:
        super().__init__(f"{where}: {detail}")
        self.reason = reason


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name (from :data:`DTYPES` only)."""
    dt = getattr(torch, name, None) if name in DTYPES else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return dt


def manifest_digest(d: Mapping[str, Any]) -> str:
    """xxh3-128 of the canonical JSON of every field but ``manifest_checksum``."""
    body = {k: v for k, v in d.items() if k != _CHECKSUM_KEY}
    return checksum_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str


@dataclass(frozen=True)
class Chunk:
    """Where one tensor (or one shard of it) lies: a ``torch.save`` blob of ``length`` bytes
    at ``offset`` in ``file``, covering ``sizes`` elements from ``offsets`` of the tensor.
    ``sizes`` is None only in version-1 manifests."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...] | None
    file: str
    offset: int
    length: int

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"offsets": list(self.offsets)}
        if self.sizes is not None:
            d["sizes"] = list(self.sizes)
        d.update(file=self.file, offset=self.offset, length=self.length)
        return d


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    sharded: bool
    stats: dict[str, float] | None
    chunks: tuple[Chunk, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "stats": self.stats,
            "sharded": self.sharded,
            "chunks": [c.to_json() for c in self.chunks],
        }


@dataclass(frozen=True)
class CheckpointManifest:
    """The content of ``step-N/manifest.json``; read with :meth:`from_json` (validates it
    all), write with :meth:`to_json`."""

    step: int
    world_size: int
    ranks: dict[int, str]
    """rank -> its state file (``state-rank<r>.json``)."""
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    counters: dict[str, int]
    data_state: Any = None
    created: float | None = None
    unbroken_version: str = "?"
    torch_version: str = "?"
    save_seconds: float | None = None
    blocked_seconds: float | None = None
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Fields this version does not know (a later minor addition), kept as read."""

    @property
    def sharded(self) -> bool:
        return any(t.sharded for t in self.tensors.values())

    @property
    def data_files(self) -> list[str]:
        """Files holding tensor data, sorted."""
        return sorted({c.file for t in self.tensors.values() for c in t.chunks})

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    # --- writing --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "world_size": self.world_size,
            "ranks": {str(r): {"state": n} for r, n in sorted(self.ranks.items())},
            "unbroken_version": self.unbroken_version,
            "torch_version": self.torch_version,
            "checksum_algo": CHECKSUM_ALGO,
            "files": {
                n: {"size": f.size, "checksum": f.checksum} for n, f in sorted(self.files.items())
            },
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "counters": dict(self.counters),
            "data_state": self.data_state,
            "save_seconds": self.save_seconds,
            "blocked_seconds": self.blocked_seconds,
            **self.extra,
        }
        d = json.loads(json.dumps(d))  # plain JSON (int keys -> str, tuples -> lists) first
        d[_CHECKSUM_KEY] = manifest_digest(d)
        return d

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1).encode()

    # --- reading --------------------------------------------------------------------------

    @classmethod
    def from_json(cls, raw: bytes, *, step: int | None, where: str) -> CheckpointManifest:
        """Parse and fully validate ``raw`` (the bytes of ``where``); ``step`` is the step
        its directory names (None: any). Raises :class:`ManifestError` naming the field."""
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ManifestError(where, f"not valid JSON ({e})") from e
        return cls.from_dict(d, step=step, where=where)

    @classmethod
    def from_dict(cls, d: Any, *, step: int | None, where: str) -> CheckpointManifest:
        v = _Checker(where)
        v.require(isinstance(d, dict) and d.get("format") == FORMAT, "is not an unbroken checkpoint manifest")
        version = d.get("version")
        v.require(
            type(version) is int and version in READABLE_VERSIONS,
            f"has format version {version!r}; this unbroken reads versions "
            f"{list(READABLE_VERSIONS)} (upgrade unbroken)",
        )
        if version >= 2:
            got = d.get(_CHECKSUM_KEY)
            v.require(
                isinstance(got, str) and got == manifest_digest(d),
                "does not match its own checksum (a changed or flipped field)",
            )
        mstep = v.int_(d.get("step"), "step")
        v.require(step is None or mstep == step, f"says step {mstep}, its directory says {step}")
        world = v.int_(d.get("world_size"), "world_size", lo=1)
        v.require(d.get("checksum_algo", CHECKSUM_ALGO) == CHECKSUM_ALGO, f"checksum_algo is not {CHECKSUM_ALGO}")

        files: dict[str, FileEntry] = {}
        for name, f in v.dict_(d.get("files"), "files").items():
            v.name(name, "files")
            f = v.dict_(f, f"files[{name!r}]")
            files[name] = FileEntry(
                v.int_(f.get("size"), f"files[{name!r}].size"),
                v.hex32(f.get("checksum"), f"files[{name!r}].checksum"),
            )
        v.require(METADATA in files, f"does not list {METADATA}")

        ranks: dict[int, str] = {}
        for r, e in v.dict_(d.get("ranks"), "ranks").items():
            v.require(r.isdigit() and str(int(r)) == r, f"ranks has a non-rank key {r!r}")
            state = v.dict_(e, f"ranks[{r!r}]").get("state")
            v.require(isinstance(state, str) and state in files, f"ranks[{r!r}].state {state!r} is not a listed file")
            ranks[int(r)] = str(state)
        v.require(
            sorted(ranks) == list(range(world)),
            f"lists state files for ranks {sorted(ranks)}, world_size is {world}",
        )

        data_names = set(files) - set(ranks.values()) - {METADATA}
        tensors = {
            k: v.tensor(k, t, files, data_names, version)
            for k, t in v.dict_(d.get("tensors"), "tensors").items()
        }
        counters = {
            k: v.int_(c, f"counters[{k!r}]", lo=None)
            for k, c in v.dict_(d.get("counters", {}), "counters").items()
        }
        created = v.num(d.get("created"), "created", optional=True)
        return cls(
            step=mstep,
            world_size=world,
            ranks=ranks,
            files=files,
            tensors=tensors,
            counters=counters,
            data_state=d.get("data_state"),
            created=created,
            unbroken_version=str(d.get("unbroken_version", "?")),
            torch_version=str(d.get("torch_version", "?")),
            save_seconds=v.num(d.get("save_seconds"), "save_seconds", optional=True),
            blocked_seconds=v.num(d.get("blocked_seconds"), "blocked_seconds", optional=True),
            version=version,
            extra={k: x for k, x in d.items() if k not in _KNOWN},
        )

    # --- the directory ----------------------------------------------------------------------

    def check_files(self, directory: str) -> None:
        """Every listed file is a regular file (never a symlink, which could lead out of the
        step directory) of its recorded size. Opens nothing."""
        for name, f in self.files.items():
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError as e:
                raise ManifestError(path, "is missing", "missing-file") from e
            if stat.S_ISLNK(st.st_mode):
                raise ManifestError(path, "is a symlink; checkpoint files must lie in the step directory", "symlink")
            if not stat.S_ISREG(st.st_mode):
                raise ManifestError(path, "is not a regular file", "missing-file")
            if st.st_size != f.size:
                raise ManifestError(path, f"has {st.st_size} bytes, manifest says {f.size}", "size")


class _Checker:
    """Field checks that raise :class:`ManifestError` naming the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            raise ManifestError(self.where, what)

    def int_(self, x: Any, what: str, lo: int | None = 0) -> int:
        self.require(
            isinstance(x, int) and not isinstance(x, bool) and (lo is None or x >= lo),
            f"{what}={x!r} is not an integer" + (f" >= {lo}" if lo is not None else ""),
        )
        return int(x)

    def num(self, x: Any, what: str, optional: bool = False) -> float | None:
        if x is None and optional:
            return None
        self.require(isinstance(x, int | float) and not isinstance(x, bool), f"{what}={x!r} is not a number")
        return float(x)

    def hex32(self, x: Any, what: str) -> str:
        self.require(isinstance(x, str) and bool(_HEX32_RE.match(x)), f"{what}={x!r} is not an xxh3-128 hex digest")
        return str(x)

    def dict_(self, x: Any, what: str) -> dict[str, Any]:
        self.require(isinstance(x, dict), f"{what} is not a JSON object")
        return x  # type: ignore[no-any-return]

    def ints(self, x: Any, what: str) -> tuple[int, ...]:
        self.require(isinstance(x, list), f"{what}={x!r} is not a list of integers")
        return tuple(self.int_(i, what) for i in x)

    def name(self, name: str, what: str) -> None:
        # Plain names only: no "/" (so no "../x" and no absolute path), not "." or "..".
        self.require(
            bool(_NAME_RE.match(name)) and name not in (".", "..", MANIFEST),
            f"{what} names {name!r}, which is not a plain file name inside the step directory",
        )

    def tensor(
        self, key: str, t: Any, files: Mapping[str, FileEntry], data_names: set[str], version: int
    ) -> TensorEntry:
        what = f"tensors[{key!r}]"
        t = self.dict_(t, what)
        dtype = t.get("dtype")
        self.require(dtype in DTYPES, f"{what}.dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        try:
            torch_dtype(dtype)
        except ValueError as e:
            raise ManifestError(self.where, f"{what}.dtype={dtype!r} is unknown to torch {torch.__version__}") from e
        shape = self.ints(t.get("shape"), f"{what}.shape")
        sharded = t.get("sharded", False)
        self.require(isinstance(sharded, bool), f"{what}.sharded={sharded!r} is not true/false")
        stats = t.get("stats")
        # We record no statistics for sharded tensors (a DTensor's would need collectives).
        self.require(not (sharded and stats is not None), f"{what} is sharded but has stats")
        if stats is not None:
            stats = self.dict_(stats, f"{what}.stats")
            self.require(set(stats) == {"sum", "norm"}, f"{what}.stats has keys {sorted(stats)}, not sum and norm")
            stats = {k: self.num(x, f"{what}.stats.{k}") for k, x in stats.items()}
        raw_chunks = t.get("chunks")
        self.require(isinstance(raw_chunks, list) and len(raw_chunks) > 0, f"{what}.chunks is not a non-empty list")
        chunks = []
        volume = 0
        for i, c in enumerate(raw_chunks):
            cw = f"{what}.chunks[{i}]"
            c = self.dict_(c, cw)
            offsets = self.ints(c.get("offsets"), f"{cw}.offsets")
            sizes = None if version < 2 and "sizes" not in c else self.ints(c.get("sizes"), f"{cw}.sizes")
            self.require(len(offsets) == len(shape), f"{cw}.offsets has {len(offsets)} dims, shape {len(shape)}")
            if sizes is not None:
                self.require(
                    len(sizes) == len(shape) and all(o + n <= s for o, n, s in zip(offsets, sizes, shape, strict=True)),
                    f"{cw} (offsets {list(offsets)}, sizes {list(sizes)}) lies outside shape {list(shape)}",
                )
                volume += math.prod(sizes)
            else:
                self.require(all(o < max(s, 1) for o, s in zip(offsets, shape, strict=True)), f"{cw}.offsets outside shape")
            name = c.get("file")
            if not isinstance(name, str):
                raise ManifestError(self.where, f"{cw}.file is not a string")
            self.name(name, f"{cw}.file")
            self.require(name in data_names, f"{cw}.file {name!r} is not a listed data file")
            offset = self.int_(c.get("offset"), f"{cw}.offset")
            length = self.int_(c.get("length"), f"{cw}.length", lo=1)
            self.require(
                offset + length <= files[name].size,
                f"{cw} (bytes {offset}..{offset + length}) lies outside {name} ({files[name].size} bytes)",
            )
            chunks.append(Chunk(offsets, sizes, name, offset, length))
        if all(c.sizes is not None for c in chunks):
            self.require(volume == math.prod(shape), f"{what}.chunks cover {volume} elements, shape has {math.prod(shape)}")
        if not sharded:
            only = chunks[0]
            self.require(
                len(chunks) == 1 and not any(only.offsets) and only.sizes in (None, shape),
                f"{what} is not sharded but is not one whole chunk",
            )
        return TensorEntry(dtype, shape, sharded, stats, tuple(chunks))
