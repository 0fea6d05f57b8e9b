"""``Checkpointer``: save (sync or async), verify, restore with fall-back, retention, archive.

Typical loop::

    ckpt = Checkpointer("ckpts", state, every_steps=100, keep_last=3, async_save=True)
    start = ckpt.restore() or 0          # newest checkpoint that verifies, else None
    for step in range(start, total):
        train_one_step(); state.step = step + 1
        ckpt.maybe_save()                # at optimizer-step boundaries only
    ckpt.close()                         # waits for the last background save

Multi-rank jobs call the same methods on every rank at the same step (they are collective).
Every rank writes its own DCP files; rank 0 commits once all ranks' data is durable.
Restore is collective too: ranks agree on the newest checkpoint that verifies everywhere.
Whatever differs between ranks is saved per rank and restored to the same rank
(:mod:`.per_rank`).

One writer per root (C-ONE-WRITER, :mod:`.lock`): the first ``restore()`` or ``save()``
takes the root's lock (rank 0 holds it for the job) and ``close()`` releases it; a second
run on the same root is refused with the holder named. ``list``/``latest``/``verify``
never take it.

Async saves (C-ASYNC): ``save()`` blocks only while tensors are copied into reusable host
buffers (pinned when on CUDA); a background thread writes and commits with the same
protocol. At most one save is in flight; a background error is raised by the next call
(``save``/``maybe_save``/``wait``/``close``). Checkpoint collectives run on a dedicated gloo
group so they never interleave with the training loop's collectives.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

import unbroken
from unbroken.ckpt import _dist, codec, lock, per_rank, schema
from unbroken.ckpt import rng as _rng
from unbroken.ckpt.apply import Plan, fit_problems
from unbroken.ckpt.config import ArchiveConfig, CheckpointConfig
from unbroken.ckpt.manifest import CheckpointManifest, Chunk, FileEntry, TensorEntry
from unbroken.ckpt.snapshot import Snapshotter
from unbroken.ckpt.state import TrainState
from unbroken.ckpt.store import CheckpointInfo, CorruptCheckpoint, Store
from unbroken.ckpt.tensor_io import ItemLocation, write_tensors
from unbroken.ckpt.verify import Verified, load_verified
from unbroken.common.audit import state_audit
from unbroken.common.config import resolve
from unbroken.common.fs import atomic_write_bytes, checksum_file
from unbroken.common.jsonable import plain_json
from unbroken.common.text import printable

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)

# Checkpointer's archive keywords -> the ArchiveConfig fields they set
_ARCHIVE_FIELDS = {
    "archive_every": "every",
    "archive_keep_last": "keep_last",
    "archive_options": "storage_options",
}


def _mark(event: str, **fields: Any) -> None:
    """Recovery-phase event for ``unbroken run`` (a no-op outside the supervisor)."""
    from unbroken.common import events

    events.mark(event, **fields)


@dataclass
class _Job:
    step: int
    tmp: str
    tensors: dict[str, torch.Tensor]
    sd: dict[str, Any]
    tree: Any  # the encoded state dict (tensor references), without RNG
    rng: Any  # the encoded RNG state of this rank
    t0: float
    blocked: float = 0.0
    differing: dict[str, list[str]] = field(default_factory=dict)  # filled by _persist


class Checkpointer:
    """Crash-proof checkpoints of a :class:`TrainState` under ``root``.

    Args:
        root: checkpoint directory (a local path, or a shared filesystem for multi-node).
        state: the :class:`TrainState` to save and restore.
        config: a :class:`~unbroken.ckpt.CheckpointConfig` (what each option does, its unit
            and default). Or pass its fields as keywords instead (not both):
            ``every_steps``, ``every_seconds``, ``keep_last``, ``keep_every``,
            ``allow_fresh_start``, ``async_save``, ``io_threads``, ``save_on_sigterm``,
            ``distributed``; and for the archive (:class:`~unbroken.ckpt.ArchiveConfig`):
            ``archive`` (its URL), ``archive_every``, ``archive_keep_last``,
            ``archive_options`` (its ``every``, ``keep_last``, ``storage_options``).

    ``save_on_sigterm``: in a multi-rank job a SIGTERM seen by any rank stops every rank at
    the same step (one tiny all-reduce per :meth:`maybe_save` call), saves, and the ranks exit
    together with status 143 (torchrun stops the others as soon as one exits); your own
    process groups are left to your ``finally``. ``distributed=False``:
    e.g. only rank 0 of a DDP job checkpoints; the other ranks may restore from the same
    root (they take the writer lock only if they save).
    """

    def __init__(
        self,
        root: str,
        state: TrainState,
        *,
        config: CheckpointConfig | None = None,
        every_steps: int | None = CheckpointConfig.every_steps,
        every_seconds: float | None = CheckpointConfig.every_seconds,
        keep_last: int | None = CheckpointConfig.keep_last,
        keep_every: int | None = CheckpointConfig.keep_every,
        allow_fresh_start: bool = CheckpointConfig.allow_fresh_start,
        async_save: bool = CheckpointConfig.async_save,
        io_threads: int = CheckpointConfig.io_threads,
        archive: str | None = None,
        archive_every: int | None = None,
        archive_keep_last: int | None = None,
        archive_options: Mapping[str, Any] | None = None,
        save_on_sigterm: bool = CheckpointConfig.save_on_sigterm,
        distributed: bool | None = CheckpointConfig.distributed,
    ) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"state must be an unbroken.ckpt.TrainState, got {type(state).__qualname__}"
            )
        # the archive_* keywords fill an ArchiveConfig; None: not given
        given: dict[str, Any] = {
            k: v
            for k, v in (("archive_every", archive_every), ("archive_keep_last", archive_keep_last),
                         ("archive_options", archive_options))
            if v is not None
        }  # fmt: skip
        if given and archive is None:
            raise ValueError(
                f"{', '.join(given)} given without archive=URL; pass archive='s3://bucket/run' "
                "too, or leave them out"
            )
        keywords: dict[str, Any] = dict(
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            keep_every=keep_every,
            allow_fresh_start=allow_fresh_start,
            async_save=async_save,
            io_threads=io_threads,
            save_on_sigterm=save_on_sigterm,
            distributed=distributed,
        )
        if archive is not None:
            try:
                keywords["archive"] = ArchiveConfig(
                    archive, **{_ARCHIVE_FIELDS[k]: v for k, v in given.items()}
                )
            except ValueError as e:
                names = ", ".join(f"{k}= sets {f}" for k, f in _ARCHIVE_FIELDS.items())
                raise ValueError(f"{e} (Checkpointer's archive= sets url, {names})") from None
        c = self.config = resolve(CheckpointConfig, config, keywords, owner="Checkpointer")
        self.store = Store(root)
        self.state = state
        self.every_steps = c.every_steps
        self.every_seconds = c.every_seconds
        self.keep_last = c.keep_last
        self.keep_every = c.keep_every
        self.allow_fresh_start = c.allow_fresh_start
        self.async_save = c.async_save
        self.io_threads = c.io_threads
        self.archive_url = c.archive.url if c.archive is not None else None
        self.archive_every = c.archive.every if c.archive is not None else 1
        self._uploader: Any = None
        self._archive: Any = None
        if c.archive is not None:
            from unbroken.ckpt.archive.remote import Archive
            from unbroken.ckpt.archive.uploader import BackgroundUploader

            self._archive = Archive(c.archive)
            self._uploader = BackgroundUploader(self._archive)
        # Checkpoint collectives get their own group: a background save must never
        # interleave with the training loop's collectives on the default group.
        self._comm = _dist.Comm(c.distributed)
        self._audit = state_audit(self.state, self._comm)  # `unbroken drill` only; else no-op
        self._snap = Snapshotter()
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="unbroken-ckpt") if c.async_save else None
        )
        self._inflight: Future[str] | None = None
        self._prepared: Future[None] | None = None  # async: buffers allocated ahead
        self._last_save_time = time.monotonic()
        self.last_save_seconds: float | None = None
        self.last_blocked_seconds: float | None = None
        self.last_wait_seconds: float = 0.0
        self.last_restore_seconds: float | None = None
        self.preempted = False
        self._watch_sigterm = c.save_on_sigterm
        self._lease: lock.Lease | None = None  # rank 0's claim on the root (C-ONE-WRITER)
        self._writer = False  # every rank: the lock was taken for this checkpointer
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._warned: set[str] = set()  # components reported as differing between ranks
        if c.save_on_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        atexit.register(_flush_at_exit, weakref.ref(self))

    @property
    def rank(self) -> int:
        return self._comm.rank

    # --- queries ----------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first (not verified: see :meth:`verify`)."""
        return [self.store.info(s) for s in self.store.steps()]

    def latest(self) -> int | None:
        steps = self.store.steps()
        return steps[-1] if steps else None

    def _require_step(self, step: int) -> None:
        if step not in self.store.steps():
            raise ValueError(
                f"no committed checkpoint for step {step} in {self.store.root!r}; committed "
                f"steps: {self.store.steps() or 'none'}"
            )

    def verify(self, step: int) -> None:
        """Fully verify one checkpoint; raises :class:`CorruptCheckpoint` on damage."""
        self._require_step(step)
        load_verified(self.store, step, rank=self._comm.rank, world=self._comm.world)

    # --- save -------------------------------------------------------------------------------

    def maybe_save(self, step: int | None = None) -> bool:
        """Save if ``every_steps``/``every_seconds`` (or a SIGTERM) says so."""
        step = self.state.step if step is None else step
        self._audit.step(step)
        self._raise_background_error()
        every = self.every_seconds
        time_due = every is not None and time.monotonic() - self._last_save_time >= every
        if every is not None or self._watch_sigterm:
            # Ranks see the clock, and a SIGTERM, at different steps; a collective save needs
            # every rank at the same one, so the flags are OR-ed over the ranks each step.
            self.preempted, time_due = self._comm.any_of(self.preempted, time_due)
        if self.preempted:
            self._final_save_and_exit(step)
        due = time_due or bool(self.every_steps and step % self.every_steps == 0)
        if due and not os.path.exists(self.store.step_dir(step)):
            self.save(step)
            return True
        if self._pool is not None and self._prepared is None:
            # First step boundary without a save: let the checkpoint thread allocate the
            # snapshot buffers now (the optimizer state exists by now), not at the first save.
            self._prepared = self._pool.submit(self._snap.prepare, self._encode()[3])
        return False

    def save(self, step: int | None = None) -> str:
        """Save the complete training state as ``step`` (default ``state.step``).

        Sync: returns the committed directory. Async: returns the directory it will have
        once committed (see :meth:`wait`).
        """
        step = self.state.step if step is None else step
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        self.state.check_saveable()
        self.wait()
        if os.path.exists(self.store.step_dir(step)):
            raise FileExistsError(
                f"checkpoint for step {step} already exists at {self.store.step_dir(step)}; "
                "steps are immutable once committed"
            )
        self._take_writer_lock()
        job = self._snapshot(step)
        if self._pool is None:
            return self._persist(job)
        self._inflight = self._pool.submit(self._persist, job)
        return self.store.step_dir(step)

    def wait(self) -> str | None:
        """Block until the in-flight background save (if any) is committed; re-raise its
        error. Returns its directory. Also waits for the snapshot buffers allocated ahead of
        the first save (see :meth:`maybe_save`)."""
        if self._prepared is not None:
            self._prepared.result()
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        t0 = time.perf_counter()
        done = fut.done()
        try:
            return fut.result()
        finally:
            self.last_wait_seconds = time.perf_counter() - t0
            if not done and self.last_wait_seconds > 0.01:
                log.info(
                    "waited %.2f s for the previous checkpoint to finish writing",
                    self.last_wait_seconds,
                )

    def _raise_background_error(self) -> None:
        fut = self._inflight
        if fut is not None and fut.done() and fut.exception() is not None:
            self._inflight = None
            raise RuntimeError(
                f"background checkpoint save failed: {fut.exception()}"
            ) from fut.exception()

    def _encode(self) -> tuple[dict[str, Any], Any, Any, dict[str, torch.Tensor]]:
        """(state dict without RNG, RNG state, JSON tree, {key: live tensor})."""
        sd = self.state.state_dict()
        rng_state = sd.pop("rng", None)
        live: dict[str, torch.Tensor] = {}
        tree = codec.encode(sd, live)
        return sd, rng_state, tree, live

    def _snapshot(self, step: int) -> _Job:
        t0 = time.perf_counter()
        sd, rng_state, tree, live = self._encode()
        self._audit.saved(step, sd, rng_state)
        tensors = self._snap.take(live) if self._pool is not None else live
        rng_tree = codec.encode(rng_state, None)
        tmp = self.store.begin(step) if self.rank == 0 else ""
        tmp = self._comm.broadcast(tmp)
        blocked = time.perf_counter() - t0
        self.last_blocked_seconds = blocked
        return _Job(step, tmp, tensors, sd, tree, rng_tree, t0, blocked)

    def _split_per_rank(self, job: _Job) -> tuple[Any, dict[str, torch.Tensor]]:
        """Compare every rank's state (one all-gather of fingerprints); what differs is
        saved per rank, under this rank's own keys (C-PER-RANK, :mod:`.per_rank`)."""
        if self._comm.world < 2:
            return job.tree, job.tensors
        mine = per_rank.fingerprints(job.tree["components"], job.tensors, self.state.sharing)
        job.differing = per_rank.compare(self._comm.gather(mine))
        if self._comm.rank == 0:
            per_rank.report(job.step, job.differing, self.state, self._warned)
        return per_rank.rename(job.tree, job.tensors, job.differing, self._comm.rank)

    def _persist(self, job: _Job) -> str:
        rank, world = self._comm.rank, self._comm.world
        err: BaseException | None = None
        files: dict[str, tuple[int, str]] = {}
        locations: list[ItemLocation] = []
        meta: dict[str, Any] = {}
        own: dict[str, Any] = {}  # meta of this rank's own copies (rank 0 lists them all)
        try:
            tree, tensors = self._split_per_rank(job)
            files, locations, meta = write_tensors(
                job.tmp, tensors, threads=self.io_threads, comm=self._comm
            )
            own = {k: v for k, v in meta.items() if per_rank.split_key(k)[0] == rank}
            rank_state = json.dumps({"state": tree, "rng": job.rng}).encode()
            name = f"state-rank{rank}.json"
            files[name] = (
                len(rank_state),
                atomic_write_bytes(os.path.join(job.tmp, name), rank_state),
            )
        except BaseException as e:  # noqa: BLE001 - reported collectively below
            err = e
        reports = self._comm.gather((repr(err) if err else None, files, own))
        failed = [(r, e) for r, (e, _, _) in enumerate(reports) if e]
        path = self.store.step_dir(job.step)
        if rank == 0:
            if failed:
                self.store.abort(job.tmp)
            else:
                try:
                    all_files = {k: v for _, f, _ in reports for k, v in f.items()}
                    all_files[".metadata"] = checksum_file(os.path.join(job.tmp, ".metadata"))
                    for r, (_, _, theirs) in enumerate(reports):
                        meta.update({k: {**v, "rank": r} for k, v in theirs.items()})
                    manifest = self._manifest(job, all_files, locations, meta, world)
                    self.store.commit(job.tmp, job.step, manifest)
                except BaseException as e:  # noqa: BLE001
                    self.store.abort(job.tmp)
                    failed = [(0, repr(e))]
                    err = err or e
        failed = self._comm.broadcast(failed)
        if failed:
            if err is not None and isinstance(err, OSError) and err.errno == 28:
                raise RuntimeError(
                    f"disk full while writing checkpoint step {job.step} under "
                    f"{self.store.root!r}; the previous checkpoints are intact. Free space, "
                    "or lower keep_last"
                ) from err
            if err is not None:
                raise err
            raise RuntimeError(
                f"checkpoint step {job.step} failed on rank(s) {failed}; nothing was committed"
            )
        dt = time.perf_counter() - job.t0
        self._last_save_time = time.monotonic()
        self.last_save_seconds = dt
        if rank == 0:
            total = sum(s for _, f, _ in reports for s, _ in f.values())
            log.info(
                "saved step %d to %s: %.1f MB in %.2f s (%.2f GB/s), loop blocked %.3f s",
                job.step,
                path,
                total / 1e6,
                dt,
                total / dt / 1e9,
                job.blocked,
            )
            # "seconds" is what the save cost the training loop (Young/Daly's C).
            cost = job.blocked if self._pool is not None else dt
            _mark("saved", step=job.step, seconds=round(cost, 4), write_seconds=round(dt, 4))
            gone = self.store.prune(self.keep_last, self.keep_every, protect=[job.step])
            if gone:
                log.info("retention removed steps %s", gone)
            if self._uploader is not None and job.step % self.archive_every == 0:
                self._uploader.submit(path, job.step)
        return path

    def _manifest(
        self,
        job: _Job,
        files: Mapping[str, tuple[int, str]],
        locations: Sequence[ItemLocation],
        meta: Mapping[str, Any],
        world: int,
    ) -> CheckpointManifest:
        chunks: dict[str, list[Chunk]] = {}
        for loc in locations:
            chunks.setdefault(loc.key, []).append(
                Chunk(loc.chunk_offsets, loc.chunk_sizes, loc.file, loc.offset, loc.length)
            )
        loader = job.sd["components"].get("loader")
        return CheckpointManifest(
            step=job.step,
            world_size=world,
            ranks={r: f"state-rank{r}.json" for r in range(world)},
            files={k: FileEntry(s, c) for k, (s, c) in files.items()},
            tensors={
                k: TensorEntry(
                    v["dtype"],
                    tuple(v["shape"]),
                    v["sharded"],
                    v["stats"],
                    tuple(chunks[k]),
                    v.get("rank"),  # set for a rank's own copy of state that differed
                )
                for k, v in meta.items()
            },
            counters=dict(job.sd["counters"]),
            data_state=plain_json(loader),  # None when the loader's state is not JSON
            created=time.time(),
            unbroken_version=unbroken.__version__,
            torch_version=torch.__version__,
            save_seconds=round(time.perf_counter() - job.t0, 4),
            blocked_seconds=round(job.blocked, 4),
            extra={
                "components": per_rank.manifest_section(job.differing, self.state.sharing),
                "layouts": schema.describe(self.state.components, job.sd["components"]),
                "generators": schema.generators(self.state),
            },
        )

    # --- shutdown and preemption --------------------------------------------------------------

    def close(self) -> None:
        """Wait for the in-flight save and pending uploads; re-raise a background error."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._uploader is not None:
                self._uploader.close()
                self._uploader = None
            self._release_writer_lock()

    # --- the writer lock (C-ONE-WRITER) --------------------------------------------------------

    def _take_writer_lock(self, *, restoring: bool = False) -> None:
        """Become the root's one writer before the first restore or save; refuse (on every
        rank, with the holder named) when another live process is. Collective: rank 0
        holds the lock for the job. A non-collective checkpointer on rank > 0 of a job
        (rank 0 saves alone, everyone restores) takes it only when it saves."""
        if self._writer:
            return
        if not self._comm.enabled and restoring and _dist.is_dist():
            if torch.distributed.get_rank() != 0:
                return
        err: BaseException | None = None
        if self._comm.rank == 0:
            try:
                self._lease = lock.acquire(self.store.root)
            except Exception as e:  # noqa: BLE001 - RootLocked, not a dir, I/O: all ranks raise
                err = e
        err = self._comm.broadcast(err)
        if err is not None:
            raise err
        self._writer = True
        if self._lease is not None:  # a checkpointer dropped without close() lets go too
            self._finalizer = weakref.finalize(self, self._lease.release)

    def _release_writer_lock(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # releases the lease once
            self._finalizer = None
        self._lease = None
        self._writer = False

    def _flush_quietly(self) -> None:
        try:
            self.close()
        except BaseException as e:  # noqa: BLE001 - at interpreter exit, report and move on
            log.error("checkpoint flush at exit failed: %s", e)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        from unbroken.common.events import peer_failed

        if peer_failed():  # `unbroken run` stops us because a rank died: no save can finish
            os._exit(143)
        self.preempted = True  # act at the next step boundary, never mid-step

    def _final_save_and_exit(self, step: int) -> None:
        log.warning("SIGTERM received: saving step %d synchronously, then exiting", step)
        self.wait()
        if not os.path.exists(self.store.step_dir(step)):
            pool, self._pool = self._pool, None
            try:
                self.save(step)
            finally:
                self._pool = pool
        try:
            self.close()
        finally:  # every rank reaches the barrier, even one whose flush failed
            self._comm.leave()
        sys.exit(143)

    # --- restore ----------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> int | None:
        """Restore the newest checkpoint that verifies on every rank (or exactly ``step``).

        Returns the restored step, or None when there is nothing to restore. A checkpoint
        that fails verification in any way (T-FALL-BACK) is moved to
        ``corrupt-step-N-<reason>`` (or, where the root cannot be renamed in, e.g. a
        read-only file system, skipped) with one WARNING, and the next older one is tried.
        When no local checkpoint verifies and an archive is configured, the newest verified
        remote copy is downloaded. A root that holds files but no valid checkpoint raises,
        listing what was tried and why, unless ``allow_fresh_start=True``. A checkpoint that
        verifies but does not fit the live state (other keys, shapes or dtypes) raises a
        ``ValueError`` naming them before anything is copied: the live state is unchanged.

        A component that refuses its saved state (its own ``load_state_dict`` raises when
        restore rehearses it, before any tensor of the live state changes: see
        :mod:`.apply`) makes the next older checkpoint be tried; once one applies, those
        refused are moved aside as damaged. When the live state refuses every one (e.g. a
        loader whose dataset changed), restore raises ``ValueError`` with the first reason,
        nothing moved aside and nothing of the live state changed.
        """
        self.wait()
        if step is not None:
            self._require_step(step)
        self._take_writer_lock(restoring=True)
        rank, world = self._comm.rank, self._comm.world
        t0 = time.perf_counter()
        if rank == 0:
            self.store.remove_debris(is_stale=lambda p: not lock.writer_alive(p))
        candidates = [step] if step is not None else sorted(self.store.candidates(), reverse=True)
        tried: list[str] = []
        refused: list[tuple[int, str]] = []  # intact, but the live state refused them
        for s in self._comm.broadcast(candidates):
            why = self._try_load(s, rank, world)
            if why is None:
                return self._restored(s, t0, refused)
            tried.append(f"step {s}: {why.text}")
            if why.refused:
                refused.append((s, why.text))
            if step is not None:
                if why.refused:
                    raise ValueError(_refusal(s, why.text, self.store.root))
                raise CorruptCheckpoint(
                    s, "damaged", f"the requested checkpoint failed verification ({why.text})"
                )
        older: int | None = None
        while self._archive is not None:  # node replaced or disk lost: newest good remote copy
            fetched = None
            if rank == 0:
                from unbroken.ckpt.archive.remote import fetch_newest_valid

                fetched = fetch_newest_valid(self._archive, self.store.root, older_than=older)
            fetched = self._comm.broadcast(fetched)
            if fetched is None:
                break
            why = self._try_load(fetched, rank, world)
            if why is None:
                return self._restored(fetched, t0, refused)
            tried.append(f"step {fetched} (from {self._archive.url}): {why.text}")
            if why.refused:
                refused.append((fetched, why.text))
            older = fetched
        if refused:  # the live objects refuse every checkpoint: theirs to fix, not damage
            raise ValueError(_refusal(*refused[0], self.store.root, len(refused)))
        if self.store.has_foreign_content() and not self.allow_fresh_start:
            what = "; ".join(tried) if tried else "no step-N directory"
            raise RuntimeError(
                f"{self.store.root!r} is not empty but holds no valid checkpoint (tried: "
                f"{what}); refusing to silently start from scratch. Pass "
                "allow_fresh_start=True to start anew, or point at another directory"
            )
        if tried and rank == 0:
            log.warning(
                "no checkpoint in %s verified (%d tried); starting from scratch as "
                "allow_fresh_start=True asks",
                self.store.root,
                len(tried),
            )
        for obj in self.state.components.values():  # a fresh start: e.g. MetricLog drops
            getattr(obj, "start_fresh", lambda: None)()  # what an earlier attempt logged
        return None

    def _restored(self, s: int, t0: float, refused: Sequence[tuple[int, str]] = ()) -> int:
        for bad, why in refused:  # an older one applied: what the live state refused is damage
            self._quarantine(bad, "refused", why, f"step {s} restored instead")
        dt = time.perf_counter() - t0
        self.last_restore_seconds = dt
        self._last_save_time = time.monotonic()
        if self.rank == 0:
            log.info("restored step %d from %s in %.2f s", s, self.store.step_dir(s), dt)
        _mark("loaded", step=s, seconds=dt)
        return s

    def _try_load(self, s: int, rank: int, world: int) -> _NotLoaded | None:
        """Verify ``s`` on every rank and apply it only if all agree. Returns None when it
        was applied, else why not: damaged (quarantined or skipped already), or refused by
        the live state (left in place: the caller decides once an older one applies)."""
        ver: Verified | None = None
        why = None
        try:
            ver = load_verified(self.store, s, rank=rank, world=world)
        except CorruptCheckpoint as e:  # load_verified raises nothing else for damage
            why = (e.reason, e.detail)
        verdicts = self._comm.gather(why)
        bad = [(r, w) for r, w in enumerate(verdicts) if w]
        if bad:
            r, (reason, detail) = bad[0]
            self._quarantine(s, reason, f"rank {r}: {reason}: {detail}")
            return _NotLoaded(f"{reason}: {detail}")
        if ver is None:  # unreachable: no rank reported damage
            return _NotLoaded("not verified")
        return self._apply(ver, rank, world)

    def _quarantine(self, s: int, reason: str, why: str, then: str = "trying an older one") -> None:
        """Move damaged step ``s`` aside (rank 0), one WARNING; every rank waits for it."""
        if self._comm.rank == 0:
            where = self.store.quarantine(s, reason)
            why = printable(why)
            if isinstance(where, OSError):
                log.warning(
                    "checkpoint step %d is damaged (%s); could not move it aside (%s), "
                    "skipped; %s",
                    s, why, where.strerror or where, then,
                )  # fmt: skip
            else:
                log.warning(
                    "checkpoint step %d is damaged (%s); moved to %s, %s", s, why, where, then
                )
        self._comm.barrier()

    def _apply(self, ver: Verified, rank: int, world: int) -> _NotLoaded | None:
        # The world-size rule (C-PER-RANK) is a refusal, like the fit below: it raises
        # to the caller and never quarantines the (intact) checkpoint.
        skip = per_rank.check_resize(ver.manifest, self.state, world, rank)
        if skip:  # neither read nor decoded: those components keep their live state
            comps = {n: None if n in skip else v for n, v in ver.tree["components"].items()}
            tree = {**ver.tree, "components": comps}
            ver = dataclasses.replace(ver, tree=tree, needed=ver.needed & codec.tensor_keys(tree))
        live = self._live_tensors(ver)
        # All or nothing: every key, shape and dtype is checked on every rank before the
        # first tensor is copied into the live state. Skipped components are not compared.
        problems = [
            p for ps in self._comm.gather(fit_problems(ver, live, self.state, skip)) for p in ps
        ]
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ValueError(
                f"checkpoint step {ver.step} in {self.store.root!r} does not fit the live "
                f"state: {'; '.join(sorted(set(problems))[:5])}{more}. Nothing was restored "
                "(the live state is unchanged); build the model and optimizer as the run "
                "that saved it did, or restore from another directory"
            )
        tensors = ver.manifest.tensors
        targets = {  # what this rank's state references: live tensors, or new ones
            k: live[k] if k in live else torch.empty(tensors[k].shape, dtype=tensors[k].torch_dtype)
            for k in sorted(ver.needed)
        }
        plan = Plan(ver, self.state, targets, skip)
        refusals = self._comm.gather(plan.rehearse())  # before the first tensor byte changes
        if any(refusals):
            plan.undo()
            r, why = next((r, w) for r, w in enumerate(refusals) if w)
            return _NotLoaded(f"rank {r}: {why}", refused=True)
        plan.commit(self.store.step_dir(ver.step))
        if ver.rng is None:
            saved = ver.manifest.world_size
            _rng.derive(self.state.seed, rank, ver.step, self.state.numpy_generators)
            if rank == 0:
                log.warning(
                    "world size changed (%d -> %d ranks): per-rank RNG streams re-derived from "
                    "(seed=%d, rank, step=%d)",
                    saved,
                    world,
                    self.state.seed,
                    ver.step,
                )
        self._audit.restored(ver.step)
        return None

    def _live_tensors(self, ver: Verified) -> dict[str, torch.Tensor]:
        """The live state's tensors by checkpoint key; ``rank1/components/x`` (this rank's
        own copy in the checkpoint) restores into the live ``components/x``."""
        current = self.state.state_dict()
        current.pop("rng", None)
        live: dict[str, torch.Tensor] = {}
        codec.encode(current, live)
        for k in ver.needed:
            base = per_rank.split_key(k)[1]
            if base != k and base in live:
                live[k] = live.pop(base)
        return live


@dataclass(frozen=True)
class _NotLoaded:
    """Why a checkpoint was not applied; ``refused``: intact, but the live state refused it."""

    text: str
    refused: bool = False


def _refusal(step: int, why: str, root: str, count: int = 1) -> str:
    others = f" (and {count - 1} older one(s) the same way)" if count > 1 else ""
    return printable(
        f"checkpoint step {step} in {root!r} cannot be applied to the live state{others}: "
        f"{why}. Nothing was restored (the live state is unchanged) and nothing was moved "
        "aside; construct the components as the run that saved it did (the same data, seed "
        "and types), or restore from another directory"
    )


def _flush_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    ckpt = ref()
    if ckpt is not None:
        ckpt._flush_quietly()
