"""`unbroken data pack` / `unbroken data index`: small files, JSONL or dicts -> tar shards + index.

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
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from unbroken.common.fs import (
    atomic_write_bytes,
    checksum_bytes,
    checksum_file,
    ensure_out_dir,
    is_temp_name,
    path_str,
)
from unbroken.common.progress import Progress, progress_bar
from unbroken.common.workpool import process_pool, worker_died
from unbroken.data.manifest import MANIFEST_NAME, DatasetManifest, ShardInfo
from unbroken.data.prepare.plan import (
    BadInput,
    plan_dicts,
    plan_files,
    plan_jsonl,
    read_files,
    read_jsonl,
    scan_dir,
)
from unbroken.data.tar.reader import INDEX_SUFFIX, index_format, index_tar
from unbroken.data.tar.writer import TarShardWriter, tar_checksum

__all__ = ["PackResult", "index_directory", "pack"]

log = logging.getLogger(__name__)

_STATE = ".unbroken-pack.json"
_MIN_SHARD = 10240


@dataclass(frozen=True)
class PackResult:
    """What a pack (or index) run produced; ``seconds`` is wall time of the whole run."""

    manifest: DatasetManifest
    seconds: float
    shards_written: int
    shards_reused: int
    skipped: int = 0
    """bad inputs skipped (``skip_bad=True``): malformed lines, unreadable files, ..."""

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.manifest.shards)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


# --- shard tasks ---------------------------------------------------------------------------


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


def _shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


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
    if index_format(raw) != 2:
        log.info("%s: index without per-sample checksums (older format); rewriting", task.path)
        return None
    # In-memory samples: the plan digest covers keys and sizes only, so compare the content
    # through the checksum of the tar that would be written (hashing only, no write).
    if task.kind == "mem" and tar_checksum(task.payload) != (info.bytes, info.checksum):
        log.info("%s: input content changed since the shard was committed; rewriting", task.path)
        return None
    return info


def _build(task: _Task) -> ShardInfo | TarShardWriter:
    """A verified committed shard to keep, or a writer holding the new shard's bytes."""
    kept = _verify_reuse(task)
    if kept is not None:
        return kept
    w = TarShardWriter(task.path, fsync=task.fsync)
    try:
        if task.kind == "files":
            w.add_many(read_files(task.payload))
        elif task.kind == "jsonl":
            w.add_many(read_jsonl(*task.payload))
        else:
            for b in task.payload:
                w.add_batch(b)
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
    except (OSError, ValueError, RecursionError):  # json recurses per level of nesting
        return {}
    if not isinstance(st, dict) or st.get("config") != config:
        return {}
    shards = st.get("shards")
    return shards if isinstance(shards, dict) else {}


def _reusable(rec: Any, plan: str) -> ShardInfo | None:
    """The committed shard a state record names for this plan (verified before it is kept);
    None for another plan or a damaged record: the shard is written again."""
    if not isinstance(rec, dict) or rec.get("plan") != plan:
        return None
    try:
        return ShardInfo.from_json(rec["info"])
    except (KeyError, TypeError, ValueError):
        log.info("damaged record in the pack state file; rewriting its shard")
        return None


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


def _run_tasks(
    tasks: Iterable[_Task], workers: int, on_done: Callable[[int, ShardInfo, bool], None]
) -> None:
    """Write shards with at most 2*workers in flight; this thread plans and records.

    Planning here means planning errors surface in the caller's thread, and the bound keeps
    memory flat whatever the input size. ``workers == 1`` runs in this process
    with one helper thread: this thread builds each shard, the helper fsyncs and publishes
    the previous one (waiting on the disk without the GIL), so the flush overlaps CPU work.
    More run in worker processes (:func:`~unbroken.common.workpool.process_pool`); on an
    error the shards not started are cancelled and the ones being written finish or abort.
    """
    if workers <= 1:
        ex = ThreadPoolExecutor(1, thread_name_prefix="unbroken-pack")

        def submit(t: _Task) -> Any:
            r = _build(t)
            if isinstance(r, ShardInfo):
                return _Done((t.index, r, False))
            return ex.submit(_publish, t, r)

        with ex:
            _drive(tasks, submit, 2, on_done)
        return
    with process_pool(workers) as pool:
        _drive(tasks, lambda t: pool.submit(_write_task, t), 2 * workers, on_done)


def _drive(
    tasks: Iterable[_Task],
    submit: Callable[[_Task], Any],
    inflight: int,
    on_done: Callable[[int, ShardInfo, bool], None],
) -> None:
    """Submit ``tasks`` in order, at most ``inflight`` unrecorded, recording each in order."""
    pending: collections.deque[tuple[_Task, Any]] = collections.deque()
    try:
        for t in tasks:
            pending.append((t, submit(t)))
            while pending and (len(pending) >= inflight or pending[0][1].done()):
                on_done(*pending[0][1].result())
                pending.popleft()
        while pending:
            on_done(*pending[0][1].result())
            pending.popleft()
    except BrokenProcessPool as e:
        raise worker_died(pending[0][0].path if pending else "pack", e) from None
    # On an error the shards in flight finish or abort in the shutdown of the process pool
    # (bounded: workpool._DRAIN_S, then SIGKILL) or of the thread executor (its one publish);
    # waiting for them here, unbounded and swallowing every Ctrl-C, held the error for good
    # behind a hung worker.


class _Done:
    """An already available result with the futures interface."""

    def __init__(self, value: Any) -> None:
        self._v = value

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        return self._v


def _refuse_inside(src: str, out: str) -> None:
    """A directory packed into itself would take its own shards as samples next time."""
    s, o = os.path.realpath(src), os.path.realpath(out)
    if os.path.commonpath([s, o]) == s:
        raise ValueError(
            f"pack output {out!r} is inside the directory it packs ({src!r}); pass an output "
            "directory outside it"
        )


def _input_kind(src: str | Iterable[dict[str, Any]]) -> tuple[str, str, Iterable[dict[str, Any]]]:
    """(kind, path, items): ``files`` (a directory), ``jsonl`` (a file) or ``mem`` (dicts)."""
    if not isinstance(src, str | os.PathLike):
        return "mem", "", src
    path = os.fspath(src)
    if os.path.isdir(path):
        return "files", path, ()
    if os.path.isfile(path):
        return "jsonl", path, ()
    raise FileNotFoundError(f"{path}: pack input not found (a directory or .jsonl file)")


def _plan_input(
    kind: str,
    path: str,
    items: Iterable[dict[str, Any]],
    shard_size: int,
    allow_partial: bool,
    bad: BadInput,
) -> tuple[Iterator[tuple[Any, str]], int | None]:
    """The shard plans (payload, plan digest) of the input, and its size in bytes for the
    progress bar when it has one (its ETA then holds; an iterable of dicts has none)."""
    if kind == "files":
        samples = scan_dir(path, bad)
        if not samples:
            raise ValueError(f"{path}: no files to pack")
        total = sum(m[2] for smp in samples for m in smp.members)
        return plan_files(samples, shard_size, path, allow_partial), total
    if kind == "jsonl":
        plans = (((path, lines), d) for lines, d in plan_jsonl(path, shard_size, bad))
        return plans, os.path.getsize(path)
    return plan_dicts(items, shard_size, "pack input", allow_partial), None


class _PackRun:
    """The bookkeeping of one pack: the tasks it hands out (a shard whose plan is unchanged
    since an earlier run is reused) and what each finished shard adds to the state file, the
    result and the progress bar."""

    def __init__(
        self,
        out: str,
        config: dict[str, Any],
        state: dict[str, dict[str, Any]],
        kind: str,
        fsync: bool,
        bar: Progress,
        t0: float,
    ) -> None:
        self.out, self.config, self.state, self.kind, self.fsync = out, config, state, kind, fsync
        self.bar, self.t0 = bar, t0
        self.infos: dict[int, ShardInfo] = {}
        self.counts = {"written": 0, "reused": 0}
        self.input_bytes: dict[int, int] = {}
        self.plans_by_name: dict[str, str] = {}
        self.done: dict[str, dict[str, Any]] = {}

    def tasks(self, plans: Iterator[tuple[Any, str]]) -> Iterator[_Task]:
        intact = True  # what OUT held is a dataset until the first shard of it changes
        for i, (payload, plan) in enumerate(plans):
            name = _shard_name(i)
            reuse = _reusable(self.state.get(name), plan)
            if intact and not reuse:
                # Bad input found before this point (a malformed first line) loses nothing.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.out, MANIFEST_NAME))
                intact = False
            self.plans_by_name[name] = plan
            if self.kind == "files":
                self.input_bytes[i] = sum(m[2] for smp in payload for m in smp.members)
            elif self.kind == "jsonl":
                lines = payload[1]
                self.input_bytes[i] = lines[-1][1] + lines[-1][2] + 1 - lines[0][1] if lines else 0
            yield _Task(
                i, os.path.join(self.out, name), plan, self.kind, payload, self.fsync, reuse
            )

    def on_done(self, i: int, info: ShardInfo, written: bool) -> None:
        self.infos[i] = info
        self.counts["written" if written else "reused"] += 1
        self.done[info.name] = {"plan": self.plans_by_name[info.name], "info": info.to_json()}
        _save_state(self.out, self.config, self.done)
        self.bar.update(self.input_bytes.pop(i, info.bytes))
        n = sum(s.samples for s in self.infos.values())
        rate = n / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{n:,} samples, {rate:,.0f} samples/s", refresh=False)


def pack(
    src: str | os.PathLike[str] | Iterable[dict[str, Any]],
    out: str | os.PathLike[str],
    *,
    shard_size: int = 256 << 20,
    workers: int | None = None,
    allow_partial: bool = False,
    fsync: bool = True,
    progress: bool = True,
    skip_bad: bool = False,
) -> PackResult:
    """Pack ``src`` (directory, ``.jsonl`` file, or iterable of dicts) into tar shards in ``out``.

    ``shard_size`` is the target size in bytes of each tar (a sample is never split);
    ``workers`` defaults to the CPU count (1 for an iterable, whose samples live in this
    process). Raises ValueError/RuntimeError naming the file (``file:line`` for a malformed
    JSONL line) or sample for bad input; with ``skip_bad`` malformed lines, unreadable files,
    symlink loops and non-UTF-8 names are skipped instead and counted in ``skipped``.
    """
    src, out = path_str(src), path_str(out)
    if shard_size < _MIN_SHARD:
        raise ValueError(f"shard_size={shard_size} is below the minimum; pass >= {_MIN_SHARD}")
    t0 = time.perf_counter()
    kind, path, items = _input_kind(src)
    if workers is None:
        workers = 1 if kind == "mem" else min(os.cpu_count() or 1, 8)
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    if kind == "files":
        _refuse_inside(path, out)
    ensure_out_dir(out)
    config = {"shard_size": shard_size, "kind": kind}
    state = _load_state(out, config)

    bad = BadInput(skip_bad)
    plans, total = _plan_input(kind, path, items, shard_size, allow_partial, bad)
    bar = progress_bar("pack", total=total, unit="B", enabled=progress)
    run = _PackRun(out, config, state, kind, fsync, bar, t0)
    with bar:
        _run_tasks(run.tasks(plans), workers, run.on_done)
    shards = [run.infos[i] for i in range(len(run.infos))]
    with contextlib.suppress(FileNotFoundError):  # shards beyond the new input go next
        os.unlink(os.path.join(out, MANIFEST_NAME))
    _cleanup(out, {s.name for s in shards})
    manifest = DatasetManifest.create("tar", shards, extra={"tool": "unbroken pack"})
    manifest.save(out)
    secs = time.perf_counter() - t0
    res = PackResult(manifest, secs, run.counts["written"], run.counts["reused"], bad.count)
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


def index_directory(
    root: str | os.PathLike[str], *, workers: int | None = None, progress: bool = True
) -> PackResult:
    """Index every ``*.tar`` in ``root`` in place (e.g. webdataset shards) and write
    ``dataset.json``; the tar files are not modified. Shards are ordered by name."""
    root = path_str(root)
    t0 = time.perf_counter()
    if not os.path.isdir(root):
        if not os.path.lexists(root):
            raise FileNotFoundError(f"{root}: no such directory (of .tar shards to index)")
        raise ValueError(
            f"{root}: not a directory; `unbroken data index DIR` indexes every .tar in DIR - pass "
            "the directory that holds the shards"
        )
    names = sorted(n for n in os.listdir(root) if n.endswith(".tar") and not is_temp_name(n))
    if not names:
        raise ValueError(f"{root}: no .tar shards to index")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, MANIFEST_NAME))
    paths = [os.path.join(root, n) for n in names]
    workers = min(workers or os.cpu_count() or 1, len(paths))
    try:
        total: int | None = sum(os.path.getsize(p) for p in paths)
    except OSError:
        total = None  # a shard that vanished: _index_one names it
    with progress_bar("index", total=total, unit="B", enabled=progress) as bar:
        if workers <= 1:
            shards = []
            for p in paths:
                shards.append(_index_one(p))
                bar.update(shards[-1].bytes)
        else:
            with process_pool(workers) as pool:
                # map keeps the name order; the bar moves as each shard's turn comes
                shards = []
                try:
                    for info in pool.map(_index_one, paths):
                        shards.append(info)
                        bar.update(info.bytes)
                except BrokenProcessPool as e:
                    raise worker_died(paths[len(shards)], e) from None
    manifest = DatasetManifest.create("tar", shards, extra={"tool": "unbroken index"})
    manifest.save(root)
    return PackResult(manifest, time.perf_counter() - t0, len(shards), 0)
