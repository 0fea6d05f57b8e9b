"""Planning for `unbroken data pack`: turn each input kind into samples and cut shard boundaries.

Every planner yields ``(payload, plan digest)`` per shard, in order: the payload is what a
worker needs to write the shard, the digest identifies the planned content so a re-run can
keep a committed shard whose plan is unchanged. Boundaries follow one greedy rule
(:class:`Planner`): add samples while the tar body fits :func:`body_capacity`; a sample is
never split.
"""

from __future__ import annotations

import itertools
import json
import logging
import operator
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from unbroken.common.fs import hasher
from unbroken.data.tar.reader import split_member_name
from unbroken.data.tar.writer import MemberBatch, body_capacity, sample_tar_bytes

__all__ = [
    "BadInput",
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

log = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^(?:[^/]+/)*[^./][^./]*$")
_SHOW_BAD = 10  # skipped inputs logged one by one; the rest only counted


class BadInput:
    """Input that cannot be packed (a malformed JSONL line, an unreadable file, a symlink
    loop, a name that is not UTF-8): an error naming it, or - with ``skip`` (``--skip-bad``)
    - skipped, logged (the first few) and counted."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.count = 0

    def report(self, what: str) -> None:
        if not self.skip:
            raise ValueError(
                f"{what}; fix or remove it, or pass --skip-bad (skip_bad=True) to skip and "
                "count bad input"
            )
        self.count += 1
        if self.count <= _SHOW_BAD:
            log.warning("skipped bad input: %s", what)
        elif self.count == _SHOW_BAD + 1:
            log.warning("more bad input skipped; counting it without naming each")


def _shown(path: str) -> str:
    """A path for a message: as is when it is UTF-8, else the repr of its raw bytes."""
    try:
        path.encode()
    except UnicodeEncodeError:
        return repr(os.fsencode(path))
    return path


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


def scan_dir(root: str, bad: BadInput | None = None) -> list[FileSample]:
    """All samples under ``root`` in sorted path order.

    Symlinks are followed, except into a directory of the current path (a loop); a file or
    directory that cannot be read, and a name that is not UTF-8, go to ``bad`` (default: an
    error naming it). A sample with a skipped file is skipped whole.
    """
    bad = bad or BadInput(False)
    files: list[tuple[str, str, str, int, int]] = []  # rel, key, ext, size, mtime_ns
    skipped_keys: set[str] = set()

    def walk(d: str, rel: str, up: frozenset[tuple[int, int]]) -> None:
        try:
            st = os.stat(d)
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as err:
            bad.report(f"{_shown(d)}: cannot read this directory ({err.strerror})")
            return
        here = (st.st_dev, st.st_ino)
        if here in up:
            bad.report(f"{_shown(d)}: symlink loop (it leads back to a directory above it)")
            return
        up = up | {here}
        for e in entries:
            if e.name.startswith("."):
                continue
            r = f"{rel}{e.name}"
            try:
                r.encode()
            except UnicodeEncodeError:
                bad.report(f"{_shown(e.path)}: file name is not UTF-8; rename it")
                kv = split_member_name(r)
                skipped_keys.add(kv[0] if kv else r)
                continue
            try:
                is_dir = e.is_dir(follow_symlinks=True)
                est = None if is_dir else e.stat()
            except OSError as err:
                bad.report(f"{e.path}: cannot read ({err.strerror})")
                kv = split_member_name(r)
                skipped_keys.add(kv[0] if kv else r)
                continue
            if is_dir:
                walk(e.path, r + "/", up)
                continue
            kv = split_member_name(r)
            if kv is None:
                raise ValueError(
                    f"{e.path}: cannot group this file into a sample: its name has no "
                    "extension (<key>.<ext>); rename it or move it out of the input"
                )
            if est is None or not os.access(e.path, os.R_OK):
                bad.report(f"{e.path}: cannot read (permission denied)")
                skipped_keys.add(kv[0])
                continue
            files.append((r, kv[0], kv[1], est.st_size, est.st_mtime_ns))

    walk(root, "", frozenset())
    by_key: dict[str, list[tuple[str, str, int, int]]] = {}
    for r, key, ext, size, mtime in files:
        if key not in skipped_keys:
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


_BATCH = 1024  # samples normalized and cut per step


def plan_dicts(
    items: Iterable[dict[str, Any]], shard_size: int, src: str, partial: bool
) -> Iterator[tuple[list[MemberBatch], str]]:
    """Normalize dicts into column batches and cut shards (the per-sample hot path).

    The plan digest covers keys, extensions and sizes; the content itself is compared with a
    committed shard's checksum only when a re-run considers keeping it (see ``pack``), so a
    first run hashes each byte once, while writing.
    """
    norm = _DictNormalizer(src, partial)
    cut = _Cutter(shard_size, src)
    it = iter(items)
    first = 0
    while chunk := list(itertools.islice(it, _BATCH)):
        batch = norm.batch(chunk, first)
        first += len(chunk)
        yield from cut.add(batch)
    yield from cut.finish()


class _Cutter(Planner):
    """The greedy rule of :class:`Planner`, applied to a whole batch with numpy."""

    def __init__(self, shard_size: int, source: str) -> None:
        super().__init__(shard_size, source)
        self.parts: list[MemberBatch] = []

    def add(self, b: MemberBatch) -> Iterator[tuple[list[MemberBatch], str]]:
        nb = b.tar_bytes()
        over = np.flatnonzero(nb > self.cap)
        if over.size:
            i = int(over[0])
            raise _too_large(self.source, b.keys[i].decode(), int(nb[i]), self.shard_size)
        start = 0
        while start < len(b):
            cum = self.body + np.cumsum(nb[start:])
            k = int(np.searchsorted(cum, self.cap, side="right"))
            if k == 0:  # the next sample does not fit this (non-empty) shard
                yield self._emit()
                continue
            self.parts.append(b.slice(start, start + k))
            self.body = int(cum[k - 1])
            start += k
            if start < len(b):
                yield self._emit()

    def finish(self) -> Iterator[tuple[list[MemberBatch], str]]:
        if self.parts:
            yield self._emit()

    def _emit(self) -> tuple[list[MemberBatch], str]:
        parts, self.parts, self.body = self.parts, [], 0
        h = hasher()
        for p in parts:
            h.update(b"\0".join(p.keys))
            h.update(b"\1")
            h.update(b"\0".join(p.exts))
            h.update(p.nmem.astype("<i8").tobytes())
            h.update(p.sizes.astype("<i8").tobytes())
        return parts, str(h.hexdigest())


class _DictNormalizer:
    """Dicts -> :class:`MemberBatch`, checking keys, members and types.

    A batch whose dicts all have the same fields in the same order, with ``bytes`` values and
    plain keys, is handled column-wise by C-level iteration; any other batch goes sample by
    sample (encoding str/number/JSON values and naming the offending sample on error).
    """

    def __init__(self, src: str, partial: bool) -> None:
        self.src = src
        self.partial = partial
        self.schema: list[str] = []
        self.last_key: str | None = None
        self.fields: tuple[str, ...] | None = None
        self.exts: tuple[str, ...] = ()

    def batch(self, chunk: list[dict[str, Any]], first: int) -> MemberBatch:
        fields = tuple(chunk[0])
        b = None
        if all(map(fields.__eq__, map(tuple, chunk))):
            b = self._columns(chunk, first, fields)
        return b if b is not None else self._samples(chunk, first)

    def _columns(
        self, chunk: list[dict[str, Any]], first: int, fields: tuple[str, ...]
    ) -> MemberBatch | None:
        if fields != self.fields:
            exts = tuple(f for f in fields if f[:2] != "__")
            if not exts or any(not e or "/" in e for e in exts):
                return None  # let the per-sample path raise its precise error
            self.fields, self.exts = fields, exts
        exts = self.exts
        if "__key__" in fields:
            keys = list(map(operator.itemgetter("__key__"), chunk))
            if not _plain_keys(keys, self.last_key):
                return None
        else:
            keys = [f"{i:09d}" for i in range(first, first + len(chunk))]
        cols = [list(map(operator.itemgetter(e), chunk)) for e in exts]
        if any(set(map(type, c)) != {bytes} for c in cols):
            return None
        if not self.partial:
            _check_members(keys[0], exts, self.schema, self.src)
        self.last_key = keys[-1]
        joined = "\0".join(keys)
        kb = joined.encode().split(b"\0") if joined.isascii() else [k.encode() for k in keys]
        n, e = len(chunk), len(exts)
        datas: list[Any] = [None] * (n * e)
        for j, c in enumerate(cols):
            datas[j::e] = c
        bexts = tuple(x.encode() for x in exts)
        return MemberBatch.build(
            kb, np.full(n, e, np.int64), list(bexts) * n, datas, bexts, all_bytes=True
        )

    def _samples(self, chunk: list[dict[str, Any]], first: int) -> MemberBatch:
        out: list[Sample] = []
        for i, d in enumerate(chunk, first):
            key = d.get("__key__")
            if key is None:
                key = f"{i:09d}"
            elif key == self.last_key:
                raise _repeated(self.src, key)
            else:
                _check_key(key, f"sample #{i}")
            self.last_key = key
            members: list[Member] = []
            for ext, v in d.items():
                if ext[:2] == "__":
                    continue
                if not ext or "/" in ext:
                    raise ValueError(
                        f"sample {key!r}: extension {ext!r} is not a valid member suffix"
                    )
                members.append((ext, v if type(v) is bytes else _encode(v, key, ext)))
            if not members:
                raise ValueError(f"sample {key!r} has no members (only __ fields); add data")
            if not self.partial:
                _check_members(key, [m[0] for m in members], self.schema, self.src)
            out.append((key, members))
        return MemberBatch.from_samples(out)


def _repeated(src: str, key: str) -> ValueError:
    return ValueError(
        f"{src}: sample key {key!r} repeats right after itself; WebDataset would "
        "merge the two samples - give every sample a distinct __key__"
    )


def _plain_keys(keys: list[Any], last: str | None) -> bool:
    """Whether every key passes :func:`_check_key`'s quick test and none repeats the one
    before it (checked on the joined string, without a Python step per key)."""
    if set(map(type, keys)) != {str} or keys[0] == last:
        return False
    joined = "\0".join(keys)
    if joined.count("\0") != len(keys) - 1 or "\0\0" in joined:
        return False  # a key holds a NUL, or one is empty
    bad = ("." in joined, "//" in joined, "\0/" in joined, "/\0" in joined)
    if any(bad) or not keys[0] or not keys[-1] or joined[0] == "/" or joined[-1] == "/":
        return False
    return not any(map(operator.eq, keys, itertools.islice(keys, 1, None)))


def plan_jsonl(
    path: str, shard_size: int, bad: BadInput | None = None
) -> Iterator[tuple[list[tuple[str, int, int]], str]]:
    """Shards of ``(key, byte offset, length)`` lines; the digest covers the line bytes.

    Every line must be one JSON value (UTF-8); a malformed one goes to ``bad`` (default: an
    error naming ``file:line``, 1-based as editors count).
    """
    bad = bad or BadInput(False)
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
            try:
                json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                bad.report(f"{path}:{lineno + 1}: not a JSON line ({_why(e)})")
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


def _why(e: ValueError) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    return f"{type(e).__name__}: {e}"[:200]


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
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise ValueError(
                    f"{path}: cannot read ({e.strerror}) while packing; make it readable or "
                    "move it out of the input, then re-run pack (it resumes)"
                ) from None
            if len(data) != size:
                raise RuntimeError(
                    f"{path}: changed size during pack ({size} -> {len(data)}); "
                    "re-run pack once the input is stable"
                )
            members.append((ext, data))
        yield s.key, members
