"""`unbroken pack` / `unbroken index`: small files, JSONL or dicts -> tar shards + index.

The output of a run depends only on the input and ``shard_size``: the main process plans
every shard boundary first (a sample is never split), then worker processes write whole
shards, so 1, 2 or 4 workers give byte-identical files. Each shard is committed atomically
(temporary sibling, fsync, rename; its index last) and recorded in ``.unbroken-pack.json``
with a digest of the plan that produced it; ``dataset.json`` is written last. A re-run after
an interruption verifies and keeps every committed shard whose plan is unchanged and writes
only the rest.

Inputs:

* a directory tree: files grouped by ``<key>.<ext>`` like WebDataset (``a/0001.jpg`` +
  ``a/0001.json`` is the sample ``a/0001``); hidden files are skipped;
* a ``.jsonl`` file: each non-empty line is the sample ``<line number>`` with one member
  ``json`` holding the line's bytes unchanged;
* an iterable of dicts ``{"__key__": optional str, ext: bytes | str | int | float | dict |
  list, ...}`` (str as UTF-8, dict/list as JSON; members in the dict's order).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import multiprocessing as mp
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from unbroken._fs import atomic_write_bytes, checksum_bytes, checksum_file, hasher, is_temp_name
from unbroken.data.manifest import MANIFEST_NAME, DatasetManifest, ShardInfo
from unbroken.data.shards import (
    INDEX_SUFFIX,
    TarShardWriter,
    _nbytes,
    body_capacity,
    index_tar,
    member_tar_bytes,
    sample_tar_bytes,
    split_member_name,
)

__all__ = ["PackResult", "index_directory", "pack"]

log = logging.getLogger(__name__)

_STATE = ".unbroken-pack.json"
_MIN_SHARD = 10240
_KEY_RE = re.compile(r"^(?:[^/]+/)*[^./][^./]*$")

Member = tuple[str, Any]  # (ext, bytes-like) in memory
Sample = tuple[str, list[Member]]


@dataclass(frozen=True)
class PackResult:
    """What a pack (or index) run produced; ``seconds`` is wall time of the whole run."""

    manifest: DatasetManifest
    seconds: float
    shards_written: int
    shards_reused: int

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.manifest.shards)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


# --- turning inputs into planned samples -----------------------------------------------


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
class _FileSample:
    key: str
    members: tuple[tuple[str, str, int, int], ...]  # (ext, absolute path, size, mtime_ns)


def _scan_dir(root: str) -> list[_FileSample]:
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
    return [_FileSample(k, tuple(sorted(m))) for k, m in by_key.items()]


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


# --- planning ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Task:
    """One shard to produce; ``payload`` is what its worker needs to write it."""

    index: int
    path: str
    plan: str  # digest of (keys, exts, sizes, content identity)
    kind: str  # "files" | "jsonl" | "mem"
    payload: Any
    fsync: bool
    reuse: ShardInfo | None  # the committed shard recorded for the same plan, if any


def _too_large(src: str, key: str, nb: int, shard_size: int) -> ValueError:
    return ValueError(
        f"{src}: sample {key!r} needs {nb} bytes in a tar (plus the archive end), more than "
        f"shard_size={shard_size} allows; a sample is never split - pass a larger --shard-size"
    )


class _Planner:
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


def _shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def _plan_files(
    samples: list[_FileSample], shard_size: int, src: str, partial: bool
) -> Iterator[tuple[list[_FileSample], str]]:
    pl = _Planner(shard_size, src)
    schema: list[str] = []
    cur: list[_FileSample] = []
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


def _digest_files(samples: list[_FileSample]) -> str:
    """Names, sizes and mtimes: a changed file (like `make` and rsync judge it) re-packs."""
    h = hasher()
    for s in samples:
        for ext, _path, size, mtime in s.members:
            h.update(f"{s.key}\t{ext}\t{size}\t{mtime}\n".encode())
    return str(h.hexdigest())


def _plan_dicts(
    items: Iterable[dict[str, Any]], shard_size: int, src: str, partial: bool
) -> Iterator[tuple[list[Sample], str]]:
    """Normalize dicts into samples and cut shards in one pass (the per-sample hot loop).

    The plan digest covers every byte, key, extension and size of the shard.
    """
    pl = _Planner(shard_size, src)
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
            n = len(v) if type(v) is bytes else _nbytes(v)
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
            sizes.append(len(v) if type(v) is bytes else _nbytes(v))
    if cur:
        yield cur, _finish_digest(h, meta, sizes)


def _finish_digest(h: Any, meta: list[str], sizes: list[int]) -> str:
    h.update("\0".join(meta).encode())
    h.update(np.asarray(sizes, dtype=np.int64).tobytes())
    return str(h.hexdigest())


def _plan_jsonl(path: str, shard_size: int) -> Iterator[tuple[list[tuple[str, int, int]], str]]:
    """Shards of ``(key, byte offset, length)`` lines; the digest covers the line bytes."""
    pl = _Planner(shard_size, path)
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


def _read_jsonl(path: str, lines: list[tuple[str, int, int]]) -> Iterator[Sample]:
    """The lines of one shard: one read of their contiguous byte range."""
    start = lines[0][1]
    with open(path, "rb") as f:
        f.seek(start)
        buf = f.read(lines[-1][1] + lines[-1][2] - start)
    mv = memoryview(buf)
    for key, off, n in lines:
        yield key, [("json", mv[off - start : off - start + n])]


# --- workers -------------------------------------------------------------------------------


def _verify_reuse(task: _Task) -> ShardInfo | None:
    info = task.reuse
    if info is None:
        return None
    try:
        size, digest = checksum_file(task.path)
        with open(task.path + INDEX_SUFFIX, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if (size, digest) != (info.bytes, info.checksum) or checksum_bytes(raw) != info.index_checksum:
        log.info("%s: committed shard does not verify; rewriting it", task.path)
        return None
    return info


def _read_files(samples: list[_FileSample]) -> Iterator[Sample]:
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


def _build(task: _Task) -> ShardInfo | TarShardWriter:
    """A verified committed shard to keep, or a writer holding the new shard's bytes."""
    kept = _verify_reuse(task)
    if kept is not None:
        return kept
    w = TarShardWriter(task.path, fsync=task.fsync)
    try:
        if task.kind == "files":
            w.add_many(_read_files(task.payload))
        elif task.kind == "jsonl":
            w.add_many(_read_jsonl(*task.payload))
        else:
            w.add_many(task.payload)
        w.finish()
    except BaseException:
        w.abort()
        raise
    return w


def _publish(task: _Task, w: TarShardWriter) -> tuple[int, ShardInfo, bool]:
    """fsync + rename + index (mostly waiting on the disk, without the GIL)."""
    try:
        size, digest, raw = w.commit()
    except BaseException:
        w.abort()
        raise
    name = os.path.basename(task.path)
    info = ShardInfo(
        name=name,
        samples=w.num_samples,
        bytes=size,
        checksum=digest,
        index=name + INDEX_SUFFIX,
        index_bytes=len(raw),
        index_checksum=checksum_bytes(raw),
    )
    return task.index, info, True


def _write_task(task: _Task) -> tuple[int, ShardInfo, bool]:
    """Worker entry point: keep a verified committed shard or write it; never partial."""
    r = _build(task)
    return (task.index, r, False) if isinstance(r, ShardInfo) else _publish(task, r)


# --- the driver ----------------------------------------------------------------------------


def _load_state(out: str, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    try:
        with open(os.path.join(out, _STATE), "rb") as f:
            st = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(st, dict) or st.get("config") != config:
        return {}
    shards = st.get("shards")
    return shards if isinstance(shards, dict) else {}


def _save_state(out: str, config: dict[str, Any], shards: dict[str, dict[str, Any]]) -> None:
    data = json.dumps({"version": 1, "config": config, "shards": shards}, sort_keys=True)
    atomic_write_bytes(os.path.join(out, _STATE), data.encode(), fsync=False)


def _cleanup(out: str, keep: set[str]) -> None:
    """Remove temporaries of killed runs and shards of an older, longer plan."""
    pat = re.compile(r"^shard-\d{6}\.tar(\.idx)?$")
    for name in os.listdir(out):
        stale = pat.match(name) and name.removesuffix(INDEX_SUFFIX) not in keep
        if is_temp_name(name) or stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(out, name))


def _mp_context() -> Any:
    # fork: workers start in milliseconds and callers need no `if __name__ == "__main__"`
    # guard (spawn/forkserver re-import the main script); workers only do file I/O.
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _run_tasks(
    tasks: Iterable[_Task], workers: int, on_done: Callable[[int, ShardInfo, bool], None]
) -> None:
    """Write shards with at most 2*workers in flight; this thread plans and records.

    Planning here means planning errors surface in the caller's thread, and the bound keeps
    memory flat whatever the input size. ``workers == 1`` runs in this process
    with one helper thread: this thread builds each shard, the helper fsyncs and publishes
    the previous one (waiting on the disk without the GIL), so the flush overlaps CPU work.
    """
    submit: Callable[[_Task], Any]
    if workers <= 1:
        ex: Any = ThreadPoolExecutor(1, thread_name_prefix="unbroken-pack")

        def submit(t: _Task) -> Any:
            r = _build(t)
            if isinstance(r, ShardInfo):
                return _Done((t.index, r, False))
            return ex.submit(_publish, t, r)

        inflight, close = 2, ex.shutdown
    else:
        pool = _mp_context().Pool(workers)
        submit = lambda t: _AsyncResult(pool.apply_async(_write_task, (t,)))  # noqa: E731
        inflight, close = 2 * workers, pool.terminate
    pending: collections.deque[Any] = collections.deque()
    try:
        for t in tasks:
            pending.append(submit(t))
            while pending and (len(pending) >= inflight or pending[0].done()):
                on_done(*pending.popleft().result())
        while pending:
            on_done(*pending.popleft().result())
    finally:
        for f in pending:  # an error: let in-flight writers finish or abort before returning
            with contextlib.suppress(BaseException):
                f.result()
        close()


class _Done:
    """An already available result with the futures interface."""

    def __init__(self, value: Any) -> None:
        self._v = value

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        return self._v


class _AsyncResult:
    """multiprocessing's AsyncResult with concurrent.futures' names."""

    def __init__(self, r: Any) -> None:
        self._r = r

    def done(self) -> bool:
        return bool(self._r.ready())

    def result(self) -> Any:
        return self._r.get()


def pack(
    src: str | Iterable[dict[str, Any]],
    out: str,
    *,
    shard_size: int = 256 << 20,
    workers: int | None = None,
    allow_partial: bool = False,
    fsync: bool = True,
    progress: bool = True,
) -> PackResult:
    """Pack ``src`` (directory, ``.jsonl`` file, or iterable of dicts) into tar shards in ``out``.

    ``shard_size`` is the target size in bytes of each tar (a sample is never split);
    ``workers`` defaults to the CPU count (1 for an iterable, whose samples live in this
    process). Raises ValueError/RuntimeError naming the file or sample for bad input.
    """
    if shard_size < _MIN_SHARD:
        raise ValueError(f"shard_size={shard_size} is below the minimum; pass >= {_MIN_SHARD}")
    t0 = time.perf_counter()
    path = ""
    items: Iterable[dict[str, Any]] = ()
    if isinstance(src, str | os.PathLike):
        path = os.fspath(src)
        if os.path.isdir(path):
            kind = "files"
        elif os.path.isfile(path):
            kind = "jsonl"
        else:
            raise FileNotFoundError(f"{path}: pack input not found (a directory or .jsonl file)")
    else:
        kind, items = "mem", src
    if workers is None:
        workers = 1 if kind == "mem" else min(os.cpu_count() or 1, 8)
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    os.makedirs(out, exist_ok=True)
    # Whatever was complete before is no longer complete once we start changing shards.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(out, MANIFEST_NAME))
    config = {"shard_size": shard_size, "kind": kind}
    state = _load_state(out, config)

    plans: Iterator[tuple[Any, str]]
    if kind == "files":
        samples = _scan_dir(path)
        if not samples:
            raise ValueError(f"{path}: no files to pack")
        plans = _plan_files(samples, shard_size, path, allow_partial)
    elif kind == "jsonl":
        plans = (((path, lines), d) for lines, d in _plan_jsonl(path, shard_size))
    else:
        plans = _plan_dicts(items, shard_size, "pack input", allow_partial)

    infos: dict[int, ShardInfo] = {}
    counts = {"written": 0, "reused": 0}
    bar = _progress(progress)

    def tasks() -> Iterator[_Task]:
        for i, (payload, plan) in enumerate(plans):
            name = _shard_name(i)
            rec = state.get(name)
            reuse = ShardInfo.from_json(rec["info"]) if rec and rec.get("plan") == plan else None
            plans_by_name[name] = plan
            yield _Task(i, os.path.join(out, name), plan, kind, payload, fsync, reuse)

    plans_by_name: dict[str, str] = {}
    done: dict[str, dict[str, Any]] = {}

    def on_done(i: int, info: ShardInfo, written: bool) -> None:
        infos[i] = info
        counts["written" if written else "reused"] += 1
        done[info.name] = {"plan": plans_by_name[info.name], "info": info.to_json()}
        _save_state(out, config, done)
        if bar is not None:
            bar.update(info.bytes)
            n = sum(s.samples for s in infos.values())
            rate = n / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{n:,} samples, {rate:,.0f} samples/s", refresh=False)

    try:
        _run_tasks(tasks(), workers, on_done)
    finally:
        if bar is not None:
            bar.close()
    shards = [infos[i] for i in range(len(infos))]
    _cleanup(out, {s.name for s in shards})
    manifest = DatasetManifest.create("tar", shards, extra={"tool": "unbroken pack"})
    manifest.save(out)
    secs = time.perf_counter() - t0
    res = PackResult(manifest, secs, counts["written"], counts["reused"])
    log.info(
        "packed %d samples into %d shards (%d written, %d reused) in %.2fs, %.1f MB/s",
        manifest.num_samples,
        len(shards),
        res.shards_written,
        res.shards_reused,
        secs,
        res.mb_per_s,
    )
    return res


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread in a process that starts workers
    return tqdm(unit="B", unit_scale=True, unit_divisor=1000, desc="pack", smoothing=0)


# --- indexing existing shards --------------------------------------------------------------


def _index_one(path: str) -> ShardInfo:
    idx = index_tar(path)
    raw = idx.to_bytes()
    atomic_write_bytes(path + INDEX_SUFFIX, raw)
    name = os.path.basename(path)
    return ShardInfo(
        name=name,
        samples=idx.num_samples,
        bytes=idx.tar_bytes,
        checksum=idx.tar_checksum,
        index=name + INDEX_SUFFIX,
        index_bytes=len(raw),
        index_checksum=checksum_bytes(raw),
    )


def index_directory(root: str, *, workers: int | None = None) -> PackResult:
    """Index every ``*.tar`` in ``root`` in place (e.g. webdataset shards) and write
    ``dataset.json``; the tar files are not modified. Shards are ordered by name."""
    t0 = time.perf_counter()
    names = sorted(n for n in os.listdir(root) if n.endswith(".tar") and not is_temp_name(n))
    if not names:
        raise ValueError(f"{root}: no .tar shards to index")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, MANIFEST_NAME))
    paths = [os.path.join(root, n) for n in names]
    workers = min(workers or os.cpu_count() or 1, len(paths))
    if workers <= 1:
        shards = [_index_one(p) for p in paths]
    else:
        with _mp_context().Pool(workers) as pool:
            shards = pool.map(_index_one, paths)
    manifest = DatasetManifest.create("tar", shards, extra={"tool": "unbroken index"})
    manifest.save(root)
    return PackResult(manifest, time.perf_counter() - t0, len(shards), 0)
