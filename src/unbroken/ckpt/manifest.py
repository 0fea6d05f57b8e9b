"""``manifest.json``: the one typed description of a committed checkpoint, validated once.

Written last by the commit, so a step directory counts only once it is complete
(C-ATOMIC). :class:`CheckpointManifest` holds the files with their sizes and checksums,
every tensor with its chunks and statistics, the counters, the ranks' state files and the
manifest's own checksum (version 2; version 1 is still read). The tensor-key grammar
(``components/...``, ``rank<r>/...``) is defined here.

Every file of a checkpoint is untrusted input, so :meth:`CheckpointManifest.from_json`
checks everything before any other file is opened (types, dtypes, shapes, chunks covering
each tensor exactly once inside their file, plain file names, the self-checksum), and
parsing is bounded (:mod:`unbroken.ckpt.bounds`, T-BOUNDED); :meth:`check_files` then
checks that every listed file is a regular file of its recorded size (C-VERIFIED).

The format on disk and the full list of checks: ARCHITECTURE.md, "Design notes" > ckpt >
manifest.json.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch

from unbroken.ckpt.bounds import MAX_MANIFEST, Budget, TooCostly, load_json
from unbroken.ckpt.stats import LEGACY_STATS_ALGO, NO_STATS, STATS_ALGOS
from unbroken.common.fs import CHECKSUM_ALGO, checksum_bytes

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
    "component_of",
    "component_prefix",
    "manifest_digest",
    "rank_key",
    "split_key",
    "torch_dtype",
]

FORMAT = "unbroken-checkpoint"
FORMAT_VERSION = 4
"""4: no statistics (``stats_algo: "none"``), a checksum per plain tensor (issue 23 item
2); 3: ``stats_algo`` recorded
(issue 23); 2: the manifest's own checksum; 1: neither."""
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's own metadata (a pickle): checked, never unpickled by us
DTYPES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "complex128", "complex64",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
)  # fmt: skip
MAX_DIMS = 64
"""Dimensions a stored tensor may have (numpy's limit, which the chunk cover check uses)."""
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_HEX32_RE = re.compile(r"^[0-9a-f]{32}$")
_CHECKSUM_KEY = "manifest_checksum"
_KNOWN = frozenset(
    {
        "format", "version", "step", "created", "world_size", "ranks", "unbroken_version",
        "torch_version", "checksum_algo", "stats_algo", "files", "tensors", "counters", "data_state",
        "save_seconds", "blocked_seconds", _CHECKSUM_KEY,
    }
)  # fmt: skip


# --- tensor keys -------------------------------------------------------------------------------
# A stored tensor's key is its path in the state dict: ``components/<name>/<path>`` (``/``
# inside a name or a path segment written ``%2F``, as the codec writes it), and
# ``rank<r>/components/...`` for rank r's own copy of state that differed between ranks.

COMPONENTS = "components/"
_RANK_KEY = re.compile(r"^rank(\d+)/(components/.+)$")


def rank_key(key: str, rank: int) -> str:
    """The checkpoint key of ``rank``'s own copy of tensor ``key``."""
    return f"rank{rank}/{key}"


def split_key(key: str) -> tuple[int | None, str]:
    """``rank1/components/x`` -> ``(1, "components/x")``; a shared key -> ``(None, key)``."""
    m = _RANK_KEY.match(key)
    return (int(m.group(1)), m.group(2)) if m else (None, key)


def component_prefix(name: str) -> str:
    """``components/<name>/`` as keys spell it (``model.g`` -> ``components/model.g/``)."""
    return f"{COMPONENTS}{name.replace('/', '%2F')}/"


def component_of(key: str) -> str:
    """The component a key belongs to, as the key spells it: ``components/model/0.weight``
    and ``rank1/components/model/0.weight`` -> ``model``; another key -> its first part."""
    parts = split_key(key)[1].split("/", 2)
    return parts[1] if len(parts) > 1 and parts[0] == COMPONENTS[:-1] else parts[0]


class ManifestError(ValueError):
    """A manifest (or a file it lists) that cannot be trusted; ``reason`` is a short slug
    (``bad-manifest``, ``missing-file``, ``size``, ``symlink``) used in quarantine names."""

    def __init__(self, where: str, detail: str, reason: str = "bad-manifest") -> None:
        super().__init__(f"{where}: {detail}")
        self.reason = reason


_TORCH_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in DTYPES if isinstance(getattr(torch, n, None), torch.dtype)
}  # the fixed set, as far as this torch knows it


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name (from :data:`DTYPES` only)."""
    dt = _TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(_TORCH_DTYPES)}")
    return dt


def manifest_digest(d: Mapping[str, Any]) -> str:
    """xxh3-128 of the canonical JSON of every field but ``manifest_checksum``."""
    body = {k: v for k, v in d.items() if k != _CHECKSUM_KEY}
    return checksum_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass(frozen=True, slots=True)  # thousands per manifest: no __dict__
class FileEntry:
    size: int
    checksum: str


@dataclass(frozen=True, slots=True)  # thousands per manifest: no __dict__
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


@dataclass(frozen=True, slots=True)  # thousands per manifest: no __dict__
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    sharded: bool
    stats: dict[str, float] | None
    chunks: tuple[Chunk, ...]
    rank: int | None = None
    """The rank whose own copy this is, for state that differed between ranks (saved per
    rank as ``rank<r>/<key>``); None for state saved once."""
    checksum: str | None = None
    """Version 4: the xxh3-128 of a plain tensor's bytes (None for a sharded one)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "stats": self.stats,
            "sharded": self.sharded,
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.rank is not None:
            d["rank"] = self.rank
        d["checksum"] = self.checksum
        return d


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
    stats_algo: str = NO_STATS
    """How the tensors' ``stats`` were computed (:mod:`unbroken.ckpt.stats`): ``"none"``
    (version 4: none recorded); versions 1-2 say nothing and mean ``torch-v1``."""
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
            "stats_algo": self.stats_algo,
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
    def from_json(
        cls, raw: bytes, *, step: int | None, where: str, budget: Budget | None = None
    ) -> CheckpointManifest:
        """Parse and fully validate ``raw`` (the bytes of ``where``); ``step`` is the step
        its directory names (None: any). Raises :class:`ManifestError` naming the field.
        ``budget``: what parsing may cost (default: what ``raw`` alone justifies, see
        :mod:`unbroken.ckpt.bounds`); above :data:`~unbroken.ckpt.bounds.MAX_MANIFEST`
        bytes a manifest is refused unread."""
        if len(raw) > MAX_MANIFEST:
            raise ManifestError(
                where, f"is {len(raw)} bytes, above the {MAX_MANIFEST >> 20} MiB cap", "too-large"
            )
        try:
            d = load_json(raw, budget or Budget(len(raw)), where)
        except TooCostly as e:
            raise ManifestError(where, str(e).removeprefix(f"{where} "), "too-large") from e
        except (ValueError, RecursionError) as e:  # also a number of over 4,300 digits
            raise ManifestError(where, f"not valid JSON ({e})") from e
        try:
            return cls.from_dict(d, step=step, where=where)
        except ManifestError:
            raise
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as e:
            # a check this module missed: still damage to every caller (the archive and
            # `ckpt ls` catch ManifestError only), never a traceback
            raise ManifestError(where, f"{type(e).__name__}: {e}") from e

    @classmethod
    def from_dict(cls, d: Any, *, step: int | None, where: str) -> CheckpointManifest:
        v = _Checker(where)
        version = v.header(d)
        mstep = v.int_(d.get("step"), "step")
        v.require(step is None or mstep == step, f"says step {mstep}, its directory says {step}")
        world = v.int_(d.get("world_size"), "world_size", lo=1)
        v.require(
            d.get("checksum_algo", CHECKSUM_ALGO) == CHECKSUM_ALGO,
            f"checksum_algo is not {CHECKSUM_ALGO}",
        )
        # Before version 3 the statistics were always torch-v1 (and not named); version 4
        # records none.
        stats_algo = d.get("stats_algo") if version >= 3 else LEGACY_STATS_ALGO
        algos = [NO_STATS] if version >= 4 else list(STATS_ALGOS)
        v.require(
            stats_algo in algos,
            f"stats_algo={stats_algo!r} is not one of {algos} for format version {version} "
            "(upgrade unbroken)",
        )

        files = v.files(d.get("files"))
        ranks = v.ranks(d.get("ranks"), files, world)
        data_names = set(files) - set(ranks.values()) - {METADATA}
        tensors = {
            k: v.tensor(k, t, files, data_names, version, world, stats_algo != NO_STATS)
            for k, t in v.dict_(d.get("tensors"), "tensors").items()
        }
        v.disjoint(tensors, files)
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
            stats_algo=stats_algo,
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
                raise ManifestError(
                    path, "is a symlink; checkpoint files must lie in the step directory", "symlink"
                )
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

    def header(self, d: Any) -> int:
        """The manifest's format, readable version (returned) and own checksum (version 2)."""
        self.require(
            isinstance(d, dict) and d.get("format") == FORMAT,
            "is not an unbroken checkpoint manifest",
        )
        version = d.get("version")
        self.require(
            type(version) is int and version in READABLE_VERSIONS,
            f"has format version {version!r}; this unbroken reads versions "
            f"{list(READABLE_VERSIONS)} (upgrade unbroken)",
        )
        if version >= 2:
            got = d.get(_CHECKSUM_KEY)
            self.require(
                isinstance(got, str) and got == manifest_digest(d),
                "does not match its own checksum (a changed or flipped field)",
            )
        return int(version)

    def files(self, x: Any) -> dict[str, FileEntry]:
        files: dict[str, FileEntry] = {}
        for name, f in self.dict_(x, "files").items():
            self.name(name, "files")
            f = self.dict_(f, f"files[{name!r}]")
            files[name] = FileEntry(
                self.int_(f.get("size"), f"files[{name!r}].size"),
                self.hex32(f.get("checksum"), f"files[{name!r}].checksum"),
            )
        self.require(METADATA in files, f"does not list {METADATA}")
        return files

    def ranks(self, x: Any, files: Mapping[str, FileEntry], world: int) -> dict[int, str]:
        """rank -> its state file, one per rank of ``world``."""
        ranks: dict[int, str] = {}
        for r, e in self.dict_(x, "ranks").items():
            ok = r.isascii() and r.isdigit() and str(int(r)) == r  # "²".isdigit(), not int()
            self.require(ok, f"ranks has a non-rank key {r!r}")
            state = self.dict_(e, f"ranks[{r!r}]").get("state")
            self.require(
                isinstance(state, str) and state in files,
                f"ranks[{r!r}].state {state!r} is not a listed file",
            )
            ranks[int(r)] = str(state)
        # counted, never enumerated: world_size may claim anything
        self.require(
            len(ranks) == world and (not ranks or max(ranks) == world - 1),
            f"lists state files for {len(ranks)} rank(s), world_size is {world}",
        )
        return ranks

    def int_(self, x: Any, what: str, lo: int | None = 0) -> int:
        self.require(
            isinstance(x, int) and not isinstance(x, bool) and (lo is None or x >= lo),
            f"{what}={x!r} is not an integer" + (f" >= {lo}" if lo is not None else ""),
        )
        return int(x)

    def num(self, x: Any, what: str, optional: bool = False) -> float | None:
        if x is None and optional:
            return None
        got = _float(x)
        self.require(got is not None, f"{what}={_short(x)} is not a number")
        return got

    def tensor_checksum(
        self, key: str, t: dict[str, Any], sharded: bool, version: int
    ) -> str | None:
        """Version 4: a plain tensor's checksum (required), none for a sharded one."""
        checksum = t.get("checksum")
        if version < 4:  # not recorded before version 4 (an edited-in one is not used)
            return None
        if sharded:
            self.require(checksum is None, f"tensors[{key!r}] is sharded but has a checksum")
            return None
        return self.hex32(checksum, f"tensors[{key!r}].checksum")

    def hex32(self, x: Any, what: str) -> str:
        self.require(
            isinstance(x, str) and bool(_HEX32_RE.match(x)),
            f"{what}={x!r} is not an xxh3-128 hex digest",
        )
        return str(x)

    def dict_(self, x: Any, what: str) -> dict[str, Any]:
        self.require(isinstance(x, dict), f"{what} is not a JSON object")
        return x

    def disjoint(self, tensors: Mapping[str, TensorEntry], files: Mapping[str, FileEntry]) -> None:
        """No two chunks share a byte of a file: together with exact coverage, the tensors
        hold no more elements than the data files have bytes (what a restore allocates)."""
        ranges: dict[str, list[tuple[int, int, str]]] = {}
        for k, t in tensors.items():
            for c in t.chunks:
                ranges.setdefault(c.file, []).append((c.offset, c.offset + c.length, k))
        for name, rs in ranges.items():
            rs.sort()
            for (_, end, a), (start, _, b) in zip(rs, rs[1:], strict=False):
                self.require(
                    start >= end,
                    f"tensors[{a!r}] and tensors[{b!r}] share bytes {start}..{end} of {name}",
                )

    def name(self, name: str, what: str) -> None:
        # Plain names only: no "/" (so no "../x" and no absolute path), not "." or "..".
        self.require(
            bool(_NAME_RE.match(name)) and name not in (".", "..", MANIFEST),
            f"{what} names {name!r}, which is not a plain file name inside the step directory",
        )

    def tensor(
        self,
        key: str,
        t: Any,
        files: Mapping[str, FileEntry],
        data_names: set[str],
        version: int,
        world: int,
        with_stats: bool = True,
    ) -> TensorEntry:
        # Runs once per tensor of every manifest read (thousands per restore): plain type
        # checks, and a message only built on failure.
        def bad(detail: str) -> NoReturn:
            raise ManifestError(self.where, f"tensors[{key!r}]{detail}")

        if type(t) is not dict:
            bad(" is not a JSON object")
        dtype = t.get("dtype")
        if type(dtype) is not str or dtype not in _TORCH_DTYPES:
            bad(f".dtype={dtype!r} is not one of {', '.join(_TORCH_DTYPES)}")
        shape = _ints(t.get("shape"))
        if shape is None:
            bad(f".shape={_short(t.get('shape'))} is not a list of integers >= 0")
        if len(shape) > MAX_DIMS:
            bad(f".shape has {len(shape)} dimensions, more than {MAX_DIMS}")
        sharded = t.get("sharded", False)
        if type(sharded) is not bool:
            bad(f".sharded={sharded!r} is not true/false")
        stats = _stats(t.get("stats"), sharded, bad)
        if stats is not None and not with_stats:
            bad(" has stats, which its manifest's stats_algo 'none' says are not recorded")
        checksum = self.tensor_checksum(key, t, sharded, version)
        raw = t.get("chunks")
        if type(raw) is not list or not raw:
            bad(".chunks is not a non-empty list")
        item = _TORCH_DTYPES[dtype].itemsize
        chunks = [
            _chunk(i, c, shape, item, files, data_names, version, bad) for i, c in enumerate(raw)
        ]
        if all(c.sizes is not None for c in chunks):
            gap = _cover_error(shape, chunks)
            if gap:
                bad(f".chunks {gap}")
        if not sharded:
            only = chunks[0]
            if len(chunks) != 1 or any(only.offsets) or only.sizes not in (None, shape):
                bad(" is not sharded but is not one whole chunk")
        rank = t.get("rank")
        if rank is not None and (type(rank) is not int or not 0 <= rank < world):
            bad(f".rank={rank!r} is not a rank of the {world} that saved it")
        if (split_key(key)[0] if key.startswith("rank") else None) != rank:
            # a rank's own copy (state that differed between ranks) is keyed rank<r>/, says r
            bad(f".rank={rank!r} does not match its key")
        return TensorEntry(dtype, shape, sharded, stats, tuple(chunks), rank, checksum)


Bad = Callable[[str], NoReturn]


def _stats(stats: Any, sharded: bool, bad: Bad) -> dict[str, float] | None:
    if stats is None:
        return None
    # We record no statistics for sharded tensors (a DTensor's would need collectives).
    if sharded:
        bad(" is sharded but has stats")
    if type(stats) is not dict or stats.keys() != {"sum", "norm"}:
        bad(f".stats={stats!r} is not {{sum, norm}}")
    out = {k: _float(x) for k, x in stats.items()}
    if any(x is None for x in out.values()):
        bad(f".stats={_short(stats)} holds a non-number")
    return {k: x for k, x in out.items() if x is not None}


def _chunk(
    i: int,
    c: Any,
    shape: tuple[int, ...],
    itemsize: int,
    files: Mapping[str, FileEntry],
    data_names: set[str],
    version: int,
    bad: Bad,
) -> Chunk:
    """Chunk ``i`` of a tensor of ``shape``: inside it, and inside a listed data file that
    holds at least its elements' bytes."""
    if type(c) is not dict:
        bad(f".chunks[{i}] is not a JSON object")
    ndim = len(shape)
    offsets = _ints(c.get("offsets"))
    sizes = None if version < 2 and "sizes" not in c else _ints(c.get("sizes"))
    if offsets is None or len(offsets) != ndim:
        bad(f".chunks[{i}].offsets={c.get('offsets')!r} is not {ndim} integers >= 0")
    if sizes is not None:
        if len(sizes) != ndim or any(
            o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)
        ):
            bad(f".chunks[{i}] (offsets {c.get('offsets')}, sizes {c.get('sizes')}) lies "
                f"outside shape {list(shape)}")  # fmt: skip
    elif version >= 2:
        bad(f".chunks[{i}].sizes={c.get('sizes')!r} is not a list of integers >= 0")
    elif any(o >= max(d, 1) for o, d in zip(offsets, shape, strict=True)):
        bad(f".chunks[{i}].offsets lie outside shape {list(shape)}")
    name, offset, length = c.get("file"), c.get("offset"), c.get("length")
    # data_names are validated plain names: membership confines the path too.
    if type(name) is not str or name not in data_names:
        bad(f".chunks[{i}].file={name!r} is not a data file listed in the manifest")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 1:
        bad(f".chunks[{i}] has offset={offset!r}, length={length!r}")
    if offset + length > files[name].size:
        bad(f".chunks[{i}] (bytes {offset}..{offset + length}) lies outside {name} "
            f"({files[name].size} bytes)")  # fmt: skip
    if length < math.prod(sizes if sizes is not None else shape) * itemsize:
        # a torch.save blob holds its raw bytes: no tensor is larger than its files
        bad(f".chunks[{i}] has {length} bytes, fewer than its elements need")
    return Chunk(offsets, sizes, name, offset, length)


def _cover_error(shape: tuple[int, ...], chunks: list[Chunk]) -> str | None:
    """Why ``chunks`` do not cover ``shape`` exactly once (None when they do).

    The boundaries of all chunks cut each dimension into intervals, and the tensor into a
    grid of cells; each cell must lie in exactly one chunk. A sharded save (FSDP, tensor
    parallel, both) stores one chunk per cell, so a grid larger than a few times the number
    of chunks is refused before it is built (it would cost time and memory in a power of
    the number of chunks a manifest can list)."""
    total = math.prod(shape)
    if len(chunks) == 1:
        sizes = chunks[0].sizes
        return None if sizes == shape else f"cover {math.prod(sizes or ())} of {total} elements"
    cuts = []
    for k, d in enumerate(shape):
        ends = {c.offsets[k] + c.sizes[k] for c in chunks if c.sizes is not None}
        cuts.append(sorted({0, d, *(c.offsets[k] for c in chunks), *ends}))
    grid = math.prod(len(b) - 1 for b in cuts)
    if grid > 4 * len(chunks) + 64:
        return f"cut shape {list(shape)} into {grid} cells, not the grid of a sharded save"
    index = [{x: j for j, x in enumerate(b)} for b in cuts]
    spans = [
        tuple(slice(index[k][o], index[k][o + n]) for k, (o, n) in enumerate(zip(c.offsets, c.sizes, strict=True)))
        for c in chunks
        if c.sizes is not None and 0 not in c.sizes  # an empty shard covers nothing
    ]  # fmt: skip
    cells = sum(math.prod(s.stop - s.start for s in span) for span in spans)
    if total and cells != grid:
        return f"cover {cells} of the {grid} cells they cut shape {list(shape)} into"
    count = np.zeros([len(b) - 1 for b in cuts], dtype=np.uint8)
    for span in spans:
        count[span] += 1
    if total and count.min() != 1:
        return f"overlap and leave a gap in shape {list(shape)}"
    return None


def _float(x: Any) -> float | None:
    """``x`` as a float when it is a JSON number a float holds (an int past 1.8e308 is not)."""
    if type(x) is float:
        return x
    if type(x) is int and -sys.float_info.max <= x <= sys.float_info.max:
        return float(x)
    return None


def _short(x: Any) -> str:
    """``repr(x)`` cut to 80 characters (a crafted field can be megabytes)."""
    r = repr(x)
    return r if len(r) <= 80 else f"{r[:77]}..."


def _ints(x: Any) -> tuple[int, ...] | None:
    """``x`` as a tuple of non-negative ints, or None when it is anything else."""
    if type(x) is list and all(type(i) is int and i >= 0 for i in x):
        return tuple(x)
    return None
