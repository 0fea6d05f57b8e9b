"""Planning for `unbroken pack`: turn each input kind into samples and cut shard boundaries.

Every planner yields ``(payload, plan digest)`` per shard, in order: the payload is what a
worker needs to write the shard, the digest identifies the planned content so a re-run can
keep a committed shard whose plan is unchanged. Boundaries follow one greedy rule
(:class:`Planner`): add samples while the tar body fits :func:`body_capacity`; a sample is
never split.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from unbroken._fs import hasher
from unbroken.data.shards import split_member_name
from unbroken.data.writers import body_capacity, buffer_nbytes, member_tar_bytes, sample_tar_bytes

__all__ = [
    "FileSample",
    "Member",
    "Planner",
    "Sample",
    "plan_dicts",
    "plan_files",
    "plan_jsonl",
    "read_files",
    "read_jsonl",
    "scan_dir",
]

_KEY_RE = re.compile(r"^(?:[^/]+/)*[^./][^./]*$")

Member = tuple[str, Any]  # (ext, bytes-like) in memory
Sample = tuple[str, list[Member]]


def _check_key(key: str, where: str) -> str:
    if type(key) is str and key and "." not in key and key[0] != "/" and "//" not in key:
        return key  # the common case, decided without the regex
    if not isinstance(key, str) or not _KEY_RE.match(key) or ".." in key.split("/"):
        raise ValueError(
            f"{where}: sample key {key!r} is not usable: a key is a relative path whose last "
            "part has no '.' (WebDataset splits <key>.<ext> at the first dot); rename it"
        )
    return key


def _encode(v: Any, key: str, ext: str) -> Any:
    if type(v) is bytes or isinstance(v, bytearray):
        return v
    if isinstance(v, memoryview):  # a copy: views cannot be pickled to worker processes
        return v.tobytes()
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, bool | int | float):
        return str(v).encode()
    if isinstance(v, dict | list) or v is None:
        return json.dumps(v, sort_keys=True, separators=(",", ":")).encode()
    raise TypeError(
        f"sample {key!r}: member {ext!r} has type {type(v).__name__}; pass bytes, str, a "
        "number or a JSON-serializable dict/list"
    )


@dataclass(frozen=True)
class FileSample:
    key: str
    members: tuple[tuple[str, str, int, int], ...]  # (ext, absolute path, size, mtime_ns)


def scan_dir(root: str) -> list[FileSample]:
    """All samples under ``root`` in sorted path order."""
    files: list[tuple[str, str, str, int, int]] = []  # rel, key, ext, size, mtime_ns

    def walk(d: str, rel: str) -> None:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.name.startswith("."):
                continue
            r = f"{rel}{e.name}"
            if e.is_dir(follow_symlinks=True):
                walk(e.path, r + "/")
                continue
            kv = split_member_name(r)
            if kv is None:
                raise ValueError(
                    f"{e.path}: cannot group this file into a sample: its name has no "
                    "extension (<key>.<ext>); rename it or move it out of the input"
                )
            st = e.stat()
            files.append((r, kv[0], kv[1], st.st_size, st.st_mtime_ns))

    walk(root, "")
    by_key: dict[str, list[tuple[str, str, int, int]]] = {}
    for r, key, ext, size, mtime in files:
        by_key.setdefault(key, []).append((ext, os.path.join(root, r), size, mtime))
    return [FileSample(k, tuple(sorted(m))) for k, m in by_key.items()]


def _check_members(key: str, exts: Sequence[str], schema: list[str], where: str) -> None:
    if not schema:
        schema.extend(sorted(exts))
        return
    if sorted(exts) != schema:
        missing = sorted(set(schema) - set(exts))
        extra = sorted(set(exts) - set(schema))
        raise ValueError(
            f"{where}: sample {key!r} has members {sorted(exts)} but earlier samples have "
            f"{schema} (missing {missing}, extra {extra}); add the missing files or pass "
            "allow_partial=True (--allow-partial) for samples with optional members"
        )


def _too_large(src: str, key: str, nb: int, shard_size: int) -> ValueError:
    return ValueError(
        f"{src}: sample {key!r} needs {nb} bytes in a tar (plus the archive end), more than "
        f"shard_size={shard_size} allows; a sample is never split - pass a larger --shard-size"
    )


class Planner:
    """Greedy, deterministic shard boundaries: add samples until the next would overflow."""

    def __init__(self, shard_size: int, source: str) -> None:
        self.shard_size = shard_size
        self.cap = body_capacity(shard_size)
        self.source = source
        self.body = 0
        self.count = 0

    def fits(self, key: str, nb: int) -> bool:
        """Whether a sample of ``nb`` tar bytes fits the current shard (then it is counted)."""
        if nb > self.cap:
            raise _too_large(self.source, key, nb, self.shard_size)
        ok = self.count == 0 or self.body + nb <= self.cap
        if ok:
            self.body += nb
            self.count += 1
        return ok

    def reset(self) -> None:
        self.body = 0
        self.count = 0


def plan_files(
    samples: list[FileSample], shard_size: int, src: str, partial: bool
) -> Iterator[tuple[list[FileSample], str]]:
    pl = Planner(shard_size, src)
    schema: list[str] = []
    cur: list[FileSample] = []
    for s in samples:
        if not partial:
            _check_members(s.key, [m[0] for m in s.members], schema, src)
        nb = sample_tar_bytes(s.key, [(m[0], m[2]) for m in s.members])
        if not pl.fits(s.key, nb):
            yield cur, _digest_files(cur)
            cur = []
            pl.reset()
            pl.fits(s.key, nb)
        cur.append(s)
    if cur:
        yield cur, _digest_files(cur)


def _digest_files(samples: list[FileSample]) -> str:
    """Names, sizes and mtimes: a changed file (like `make` and rsync judge it) re-packs."""
    h = hasher()
    for s in samples:
        for ext, _path, size, mtime in s.members:
            h.update(f"{s.key}\t{ext}\t{size}\t{mtime}\n".encode())
    return str(h.hexdigest())


def plan_dicts(
    items: Iterable[dict[str, Any]], shard_size: int, src: str, partial: bool
) -> Iterator[tuple[list[Sample], str]]:
    """Normalize dicts into samples and cut shards in one pass (the per-sample hot loop).

    The plan digest covers every byte, key, extension and size of the shard.
    """
    pl = Planner(shard_size, src)
    cur: list[Sample] = []
    h, meta, sizes = hasher(), list[str](), list[int]()
    first: list[str] | None = None
    schema: list[str] = []
    last = None
    for i, d in enumerate(items):
        key = d.get("__key__")
        if key is None:
            key = f"{i:09d}"
        elif key == last:
            raise ValueError(
                f"{src}: sample key {key!r} repeats right after itself; WebDataset would "
                "merge the two samples - give every sample a distinct __key__"
            )
        else:
            _check_key(key, f"sample #{i}")
        last = key
        members: list[Member] = []
        exts: list[str] = []
        nb = 0
        for ext, v in d.items():
            if ext[:2] == "__":
                continue
            if not ext or "/" in ext:
                raise ValueError(f"sample {key!r}: extension {ext!r} is not a valid member suffix")
            if type(v) is not bytes:
                v = _encode(v, key, ext)
            n = len(v) if type(v) is bytes else buffer_nbytes(v)
            nb += member_tar_bytes(key, ext, n)
            members.append((ext, v))
            exts.append(ext)
        if not members:
            raise ValueError(f"sample {key!r} has no members (only __ fields); add data")
        if not partial and exts != first:  # the common case (same order) skips the sort
            _check_members(key, exts, schema, src)
            first = first or exts
        if not pl.fits(key, nb):
            yield cur, _finish_digest(h, meta, sizes)
            cur, h, meta, sizes = [], hasher(), [], []
            pl.reset()
            pl.fits(key, nb)
        cur.append((key, members))
        meta.append(key)
        for ext, v in members:
            h.update(v)
            meta.append(ext)
            sizes.append(len(v) if type(v) is bytes else buffer_nbytes(v))
    if cur:
        yield cur, _finish_digest(h, meta, sizes)


def _finish_digest(h: Any, meta: list[str], sizes: list[int]) -> str:
    h.update("\0".join(meta).encode())
    h.update(np.asarray(sizes, dtype=np.int64).tobytes())
    return str(h.hexdigest())


def plan_jsonl(path: str, shard_size: int) -> Iterator[tuple[list[tuple[str, int, int]], str]]:
    """Shards of ``(key, byte offset, length)`` lines; the digest covers the line bytes."""
    pl = Planner(shard_size, path)
    cur: list[tuple[str, int, int]] = []
    h = hasher()
    pos = 0
    with open(path, "rb", buffering=16 << 20) as f:
        for lineno, raw in enumerate(f):
            line = raw.rstrip(b"\r\n")
            off, pos = pos, pos + len(raw)
            if not line.strip():
                continue
            key = f"{lineno:09d}"
            nb = sample_tar_bytes(key, [("json", len(line))])
            if not pl.fits(key, nb):
                yield cur, h.hexdigest()
                cur, h = [], hasher()
                pl.reset()
                pl.fits(key, nb)
            cur.append((key, off, len(line)))
            h.update(line)
            h.update(b"\n")
    if cur:
        yield cur, h.hexdigest()


def read_jsonl(path: str, lines: list[tuple[str, int, int]]) -> Iterator[Sample]:
    """The lines of one shard: one read of their contiguous byte range."""
    start = lines[0][1]
    with open(path, "rb") as f:
        f.seek(start)
        buf = f.read(lines[-1][1] + lines[-1][2] - start)
    mv = memoryview(buf)
    for key, off, n in lines:
        yield key, [("json", mv[off - start : off - start + n])]


def read_files(samples: list[FileSample]) -> Iterator[Sample]:
    for s in samples:
        members = []
        for ext, path, size, _mtime in s.members:
            with open(path, "rb") as f:
                data = f.read()
            if len(data) != size:
                raise RuntimeError(
                    f"{path}: changed size during pack ({size} -> {len(data)}); "
                    "re-run pack once the input is stable"
                )
            members.append((ext, data))
        yield s.key, members
