"""``Checkpointer``: when to save and what to restore; the mechanisms are :mod:`.save` and
:mod:`.load`. It keeps the triggers (``every_steps``/``every_seconds``, SIGTERM), the writer
lock, the fall-back order of restore, retention and the archive.

Typical loop::

    ckpt = Checkpointer("ckpts", state, every_steps=100, keep_last=3, async_save=True)
    start = ckpt.restore() or 0          # newest checkpoint that verifies, else None
    for step in range(start, total):
        train_one_step(); state.step = step + 1
        ckpt.maybe_save()                # at optimizer-step boundaries only
    ckpt.close()                         # waits for the last background save

Multi-rank jobs call the same methods on every rank at the same step (they are collective;
ranks agree on the newest checkpoint that verifies everywhere). One writer per root
(C-ONE-WRITER): the first ``restore()`` or ``save()`` takes the root's lock, ``close()``
releases it; ``list``/``latest``/``verify`` never take it. ``save()`` blocks only for the
copy into reusable host buffers (C-ASYNC); at most one save is in flight, and a background
error is raised by the next call (``save``/``maybe_save``/``wait``/``close``).

How a save commits and a restore falls back: ARCHITECTURE.md, "Lifeline 2".
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import shutil
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

import torch

from unbroken.ckpt import lock
from unbroken.ckpt.collectives import Comm, is_dist
from unbroken.ckpt.config import ArchiveConfig, CheckpointConfig
from unbroken.ckpt.load import Loader, refusal
from unbroken.ckpt.memtier import MemoryTier, default_dir
from unbroken.ckpt.save import Job, Saver, encode
from unbroken.ckpt.say import say
from unbroken.ckpt.snapshot import Snapshotter
from unbroken.ckpt.state import TrainState
from unbroken.ckpt.store import CheckpointInfo, CorruptCheckpoint, RestoreRefused, Store
from unbroken.ckpt.verify import load_verified
from unbroken.common.audit import StateAudit, state_audit
from unbroken.common.config import configure
from unbroken.common.fs import path_str
from unbroken.common.text import printable

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)
_NOT_INSTALLED = object()  # Checkpointer._sigterm_found: no handler of ours to take back


def _mark(event: str, **fields: Any) -> None:
    """Recovery-phase event for ``unbroken run`` (a no-op outside the supervisor)."""
    from unbroken.common import events

    events.mark(event, **fields)


class Checkpointer:
    """Crash-proof checkpoints of a :class:`TrainState` under ``root``.

    Args:
        root: checkpoint directory (a local path, or a shared filesystem for multi-node).
        state: the :class:`TrainState` to save and restore.
        config: a :class:`~unbroken.ckpt.CheckpointConfig` (what each option does, its unit
            and default); default ``CheckpointConfig()``.
        **overrides: fields of the config to change, by name
            (``Checkpointer("run/ckpt", state, every_steps=500, keep_last=3)``), applied with
            ``dataclasses.replace``; remote copies: ``archive=ArchiveConfig("s3://b/run",
            every=4)``.

    ``save_on_sigterm``: in a multi-rank job a SIGTERM seen by any rank stops every rank at
    the same step (one tiny all-reduce per :meth:`maybe_save` call), saves, and the ranks exit
    together with status 143 (torchrun stops the others as soon as one exits); your own
    process groups are left to your ``finally``. ``distributed=False``:
    e.g. only rank 0 of a DDP job checkpoints; the other ranks may restore from the same
    root (they take the writer lock only if they save).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        state: TrainState,
        config: CheckpointConfig | None = None,
        **overrides: Any,
    ) -> None:
        root = path_str(root)
        if not isinstance(state, TrainState):
            raise TypeError(
                f"state must be an unbroken.ckpt.TrainState, got {type(state).__qualname__}"
            )
        self.config = configure(CheckpointConfig, config, overrides, owner="Checkpointer")
        if (
            self.config.save_on_sigterm
            and threading.current_thread() is not threading.main_thread()
        ):
            raise ValueError(
                "save_on_sigterm=True needs the Checkpointer built in the main thread (Python "
                f"runs signal handlers there only; this is {threading.current_thread().name!r}):"
                " build it in the main thread, or pass save_on_sigterm=False and set"
                " ckpt.preempted = True from a SIGTERM handler of your own"
            )
        self.store = Store(root)
        self.state = state
        # Checkpoint collectives get their own group: a background save must never
        # interleave with the training loop's collectives on the default group.
        self._comm = Comm(self.config.distributed, hold=state.process_groups)
        self._audit = state_audit(state, self._comm)  # `unbroken drill` only; else no-op
        self._saver = Saver(
            self.store,
            state,
            self._comm,
            self.config.io_threads,
            self._audit,
            direct_io=self.config.direct_io,
        )
        self._loader = Loader(self.store, state, self._comm, self._audit, quiet=self.config.quiet)
        self._archive, self._uploader = _open_archive(self.config.archive)
        self._lock = _WriterLock(self.store, self._comm)
        self._memory = (
            MemoryTier(self.config.memory_dir or default_dir(root), root, self._comm)
            if self.config.memory_every_steps
            else None
        )
        if self._memory is not None:  # the drill's state audit needs every snapshot's state
            self._memory.planning = not isinstance(self._audit, StateAudit)
        if self._memory is not None and self.config.memory_replica:  # collective: a group
            from unbroken.ckpt.replica import PeerReplica

            replica = PeerReplica.create(self._memory.store.directory, self._comm)
            if replica is not None:
                self._memory.replicate(replica)
        # the slots go when the job ends with the disk tier holding as much (close(), or a
        # checkpointer dropped without it); a crash (a SIGKILL, or an exit on an unhandled
        # exception: _flush_at_exit) leaves them for the restart
        self._memory_done = (
            weakref.finalize(self, _close_memory, self._memory, self.store)
            if self._memory is not None
            else None
        )
        self._memory_stalls: list[float] = []  # loop stall of each publish since the last save
        self._memory_note: dict[str, Any] = {}
        self._snap = Snapshotter()
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="unbroken-ckpt")
            if self.config.async_save
            else None
        )
        self._inflight: Future[str] | None = None
        self._prepared: Future[None] | None = None  # async: buffers allocated ahead
        self._deleter: ThreadPoolExecutor | None = None  # pruned steps' files, off the save
        self._deleting: list[Future[None]] = []
        self._deleting_lock = threading.Lock()
        self._last_save_time = time.monotonic()
        self._stuck = _StuckStep()
        self._rolled_back: int | None = None  # restore(step) of an older step (_supersede)
        self.last_save_seconds: float | None = None
        self.last_blocked_seconds: float | None = None
        self.last_wait_seconds: float = 0.0
        self.last_restore_seconds: float | None = None
        self.restored_tier: str | None = None  # "memory", "peer replica", "disk" or "archive"
        self.preempted = False
        self._sigterm_found: Any = _NOT_INSTALLED  # the handler close() gives SIGTERM back to
        if self.config.save_on_sigterm:
            self._sigterm_found = signal.signal(signal.SIGTERM, self._on_sigterm)
        atexit.register(_flush_at_exit, weakref.ref(self))

    @property
    def rank(self) -> int:
        return self._comm.rank

    # --- queries ----------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first (not verified: see :meth:`verify`)."""
        return [self.store.info(s) for s in self.store.steps()]

    def latest(self) -> int | None:
        """The newest committed step (not verified: :meth:`restore` verifies), or None."""
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

    def maybe_save(self, step: SupportsIndex | None = None, *, final: bool = False) -> bool:
        """Save if ``every_steps``/``every_seconds`` (or a SIGTERM) says so; ``step``
        defaults to ``state.step``. A step that does not advance over several calls is
        warned about once (the loop's counter is not reaching ``state.step``). ``final=True``
        (the loop's last step) saves whatever the triggers say; a call on every rank."""
        step = self._step(step)
        self._stuck.see(step)
        self._audit.step(step)
        self._raise_background_error()
        if final:
            self.save(step)
            self.wait()
            return True
        every, every_steps = self.config.every_seconds, self.config.every_steps
        time_due = every is not None and time.monotonic() - self._last_save_time >= every
        if every is not None or self.config.save_on_sigterm:
            # Ranks see the clock, and a SIGTERM, at different steps; a collective save needs
            # every rank at the same one, so the flags are OR-ed over the ranks each step.
            self.preempted, time_due = self._comm.any_of(self.preempted, time_due)
        if self.preempted:
            self._final_save_and_exit(step)
        due = time_due or bool(every_steps and step % every_steps == 0)
        if due:
            self._supersede()
        if due and not os.path.exists(self.store.step_dir(step)):
            self.save(step)
            return True
        mem = self.config.memory_every_steps
        if mem and step % mem == 0 and self._memory is not None:
            self._publish(self._memory, step)
            return False
        self._prepare_ahead()  # first step boundary without a save (the optimizer state exists)
        return False

    def _prepare_ahead(self) -> None:
        """Async: let the checkpoint thread allocate (pin, fault in) the snapshot buffers
        while the loop trains, not at the first save: on a GPU that is seconds for a few GiB
        (8.25 GiB: 3.5-6.2 s of ``cudaHostAlloc``, benchmarks/RESULTS.md "GPU checks")."""
        if self._pool is not None and self._prepared is None:
            self._prepared = self._pool.submit(self._snap.prepare, encode(self.state)[3])

    def save(self, step: SupportsIndex | None = None) -> str:
        """Save the complete training state as ``step`` (default ``state.step``).

        Sync: returns the committed directory. Async: returns the directory it will have
        once committed (see :meth:`wait`). Steps are immutable once committed: saving the
        newest committed step again is a no-op when the live state is bit-identical to it
        (e.g. a final ``save()`` after ``maybe_save()`` saved that step; it costs one
        verified read) and a ``FileExistsError`` naming the first difference otherwise.
        """
        step = self._step(step)
        self.state.check_saveable()
        self.wait()
        self._supersede()
        if os.path.exists(self.store.step_dir(step)):
            self._same_or_refuse(step)
            return self.store.step_dir(step)
        self._lock.take(self)
        if self._memory is not None and self._memory.replica is not None:
            self._memory.replica.drain()  # every N steps: no transfer outlives the job's groups
        self._memory_note = self._memory_cost()
        job = self._saver.snapshot(step, self._snap if self._pool is not None else None)
        self.last_blocked_seconds = job.blocked
        if self._pool is None:
            return self._persist(job)
        self._inflight = self._pool.submit(self._persist, job)
        return self.store.step_dir(step)

    def _step(self, step: SupportsIndex | None) -> int:
        """The step to save as; an explicit one also becomes ``state.step``, the counter a
        restore brings back (``save(100)`` with ``state.step`` still 0 resumed at step 0,
        with the RNG streams of step 100)."""
        given = self.state.step if step is None else step
        try:
            n = operator.index(given)  # an int, numpy integer or integer 0-d tensor
        except TypeError:
            n = -1
        if isinstance(given, bool) or n < 0:
            raise ValueError(
                f"step={given!r} must be a non-negative integer (the loop's optimizer-step "
                "counter); pass an int or set state.step"
            )
        self.state.step = n
        return n

    def _supersede(self) -> None:
        """The first save after ``restore(step)`` of an older step starts a trajectory of
        its own: the newer steps of the one rolled back are moved aside (never deleted), so
        neither a save is skipped as "already there" nor does a restart resume them; the
        memory tier's slots of those steps are invalidated (a crash resumed them)."""
        k, self._rolled_back = self._rolled_back, None
        if k is None:
            return
        if self._memory is not None:  # each rank's slots of the abandoned steps, too
            self._memory.drop_newer(k)
        if self._comm.rank == 0:
            newer = [s for s in self.store.steps() if s > k]
            for s in newer:
                self.store.quarantine(s, "superseded")
            if newer:
                log.warning(
                    "training on from step %d, restored on request: the newer steps %s of "
                    "the run rolled back are moved aside as corrupt-step-N-superseded (not "
                    "deleted)",
                    k, newer,
                )  # fmt: skip
        self._comm.barrier()

    def _same_or_refuse(self, step: int) -> None:
        """``step`` is committed: fine when it is the newest and holds the live state."""
        where = self.store.step_dir(step)
        if step != self.latest():
            raise FileExistsError(
                f"checkpoint for step {step} already exists at {where} and is not the newest "
                f"(that is step {self.latest()}); steps are immutable once committed"
            )
        diff = self._loader.difference(step)
        if diff is not None:
            raise FileExistsError(
                f"checkpoint for step {step} already exists at {where} and the live state "
                f"differs from it (first difference: {diff}); steps are immutable once "
                f"committed. The state changed since step {step} was saved but the step did "
                "not advance: set state.step to the loop's counter every step (or pass it: "
                "maybe_save(step), save(step))"
            )

    def _publish(self, memory: MemoryTier, step: int) -> None:
        """The memory tier alone: the live tensors copied straight into a slot in the loop,
        the slot's checksum and header written by the tier's thread (issue 25 speed item
        3); a publish while the previous one is still checksummed waits for it."""
        if memory.published == step or memory.disabled:
            return
        self.state.check_saveable()
        self.wait(memory=False)
        self._supersede()
        t0 = time.perf_counter()
        if not memory.publish_planned(step, self.state):  # the state changed, or no plan yet
            job = self._saver.snapshot(step, None, disk=False)
            memory.publish(job, self.state, background=True)
        self.last_blocked_seconds = time.perf_counter() - t0
        self._memory_stalls.append(self.last_blocked_seconds)

    def _memory_cost(self) -> dict[str, Any]:
        """For the next ``saved`` event: the memory tier's mean publish stall since the last
        disk save, K and the bytes its slots hold (``unbroken plan`` reads them)."""
        stalls, self._memory_stalls = self._memory_stalls, []
        if self._memory is None or not stalls:
            return {}
        return {
            "memory_seconds": round(sum(stalls) / len(stalls), 6),
            "memory_every": self.config.memory_every_steps,
            "memory_bytes": self._memory.store.nbytes(),
        }

    def wait(self, *, memory: bool = True) -> str | None:
        """Block until the in-flight background save (if any) is committed; re-raise its
        error. Returns its directory. Also waits for the snapshot buffers allocated ahead of
        the first save (see :meth:`maybe_save`), (``memory``) for the memory tier's publish
        in flight to be complete, and for the files of steps retention removed to be
        deleted."""
        if self._prepared is not None:
            self._prepared.result()
        if memory and self._memory is not None:
            self._memory.wait()
        try:
            return self._wait_save()
        finally:
            with self._deleting_lock:
                deleting, self._deleting = self._deleting, []
            for f in deleting:
                f.result()

    def _wait_save(self) -> str | None:
        fut = self._inflight
        if fut is None:
            return None
        t0 = time.perf_counter()
        done = fut.done()
        try:
            return fut.result()
        finally:
            # Forgotten only once finished: a wait interrupted (Ctrl-C) leaves the save in
            # flight, and the next save must still wait before it reuses its buffers.
            if fut.done() and self._inflight is fut:
                self._inflight = None
            self.last_wait_seconds = time.perf_counter() - t0
            if not done and self.last_wait_seconds > 0.01:
                log.info(
                    "waited %.2f s for the previous checkpoint to finish writing",
                    self.last_wait_seconds,
                )

    def _delete_later(self, path: str) -> None:
        """Delete ``path`` (a pruned step, already out of the committed set) on a thread of
        its own: a blocking save does not wait for the filesystem to free its blocks (0.15 s
        per GiB on the benchmark's disk). :meth:`wait` and :meth:`close` wait for it; a
        kill meanwhile leaves a ``.tmp-step-*`` directory the next restore removes."""
        with self._deleting_lock:
            if self._deleter is None:
                self._deleter = ThreadPoolExecutor(1, thread_name_prefix="unbroken-ckpt-delete")
            self._deleting.append(self._deleter.submit(shutil.rmtree, path, ignore_errors=True))

    def _raise_background_error(self) -> None:
        fut = self._inflight
        if fut is not None and fut.done() and fut.exception() is not None:
            self._inflight = None
            raise RuntimeError(
                f"background checkpoint save failed: {fut.exception()}"
            ) from fut.exception()

    def _persist(self, job: Job) -> str:
        """Commit ``job`` (:meth:`.Saver.commit`), then what follows a commit: the log
        line, the recovery event, retention and the archive upload (rank 0)."""
        if self._memory is not None:  # first: the memory tier is what a crash resumes from
            self._memory.publish(job, self.state)
        path, total = self._saver.commit(job)
        dt = time.perf_counter() - job.t0
        self._last_save_time = time.monotonic()
        self._stuck = _StuckStep()
        self.last_save_seconds = dt
        if self._comm.rank != 0:
            return path
        log.info(
            "saved step %d to %s: %.1f MB in %.2f s (%.2f GB/s), loop blocked %.3f s",
            job.step, path, total / 1e6, dt, total / dt / 1e9, job.blocked,
        )  # fmt: skip
        # "seconds" is what the save cost the training loop (Young/Daly's C).
        cost = job.blocked if self._pool is not None else dt
        _mark(
            "saved", step=job.step, seconds=round(cost, 4), write_seconds=round(dt, 4),
            **self._memory_note,
        )  # fmt: skip
        gone = self.store.prune(
            self.config.keep_last,
            self.config.keep_every,
            protect=[job.step],
            remove=self._delete_later,
        )
        if gone:
            log.info("retention removed steps %s", gone)
        archive = self.config.archive
        if self._uploader is not None and archive is not None and job.step % archive.every == 0:
            self._uploader.submit(path, job.step)
        return path

    # --- shutdown and preemption --------------------------------------------------------------

    def close(self) -> None:
        """Wait for the in-flight save and pending uploads; re-raise a background error."""
        self._close(crashed=False)

    def _close(self, *, crashed: bool) -> None:
        """:meth:`close`; ``crashed``: the process ends on an unhandled exception, so the
        memory tier is kept for its restart as a SIGKILL would leave it (C-TIERS)."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._deleter is not None:
                self._deleter.shutdown(wait=True)
                self._deleter = None
            if self._uploader is not None:
                self._uploader.close()
                self._uploader = None
            done = self._memory_done.detach() if self._memory_done is not None else None
            if done is not None:  # once: the finalizer's own call, told how the process ends
                _, close_memory, args, _ = done
                close_memory(*args, crashed=crashed)
            self._give_sigterm_back()
            self._lock.release()

    def _give_sigterm_back(self) -> None:
        """SIGTERM to the handler found at construction, unless the program has installed
        another since (that one is its own); only the main thread can (atexit runs there)."""
        found, self._sigterm_found = self._sigterm_found, _NOT_INSTALLED
        if found is _NOT_INSTALLED or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if found is None else found)

    def _flush_quietly(self) -> None:
        try:
            self._close(crashed=_dying_of_an_exception())
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
        :mod:`.load`) makes the next older checkpoint be tried; once one applies, those
        refused are moved aside as damaged. When the live state refuses every one (e.g. a
        loader whose dataset changed), restore raises ``ValueError`` with the first reason,
        nothing moved aside and nothing of the live state changed.

        Every refusal by the live state raises :class:`~unbroken.ckpt.RestoreRefused` (a
        ``ValueError``): it is deterministic, so under ``unbroken run`` it is also recorded
        as a ``restore_refused`` event (a configuration fault: restarting cannot help).
        Rank 0 prints one line on stderr for the restored step and for each step skipped
        (unless the user's logging shows them already, or ``quiet=True``).
        """
        try:
            return self._restore(step)
        except RestoreRefused as e:
            _mark("restore_refused", step=e.step, reason=str(e)[:4000])
            raise

    def _restore(self, step: int | None) -> int | None:
        self.wait()
        if step is not None:
            self._require_step(step)
        self._lock.take(self, restoring=True)
        t0 = time.perf_counter()
        if self._comm.rank == 0:
            self.store.remove_debris(is_stale=lambda p: not lock.writer_alive(p))
        tried = _Tried(moved=self.store.quarantined())
        candidates = [step] if step is not None else sorted(self.store.candidates(), reverse=True)
        candidates = self._comm.broadcast(candidates)
        memory = self._memory if step is None else None
        if memory is not None:
            got = self._from_memory(memory, candidates, tried)
            if got is not None:
                return self._restored(got, t0, tried.refused, **_from_tier(memory, got, tried))
        for s in candidates:
            if memory is not None and memory.older is not None and memory.older >= s:
                # every newer disk step failed: the memory step skipped as older is newest now
                got = self._from_memory(memory, [s], tried)
                if got is not None:
                    return self._restored(got, t0, tried.refused, **_from_tier(memory, got, tried))
            if self._try(s, tried, requested=step is not None):
                self._rolled_back = step  # None unless asked for: see _supersede
                return self._restored(s, t0, tried.refused, skipped=tried.line())
        got = self._from_archive(tried)
        if got is not None:
            return self._restored(got, t0, tried.refused, tier="archive", skipped=tried.line())
        self._nothing_restored(tried)
        return None

    def _from_memory(self, memory: MemoryTier, disk: Sequence[int], tried: _Tried) -> int | None:
        """The memory tier's newest step every rank holds, when not older than ``disk``'s
        newest (C-TIERS); what it skipped goes to ``tried``."""
        newest = next(iter(disk), None)
        got, tried.memory = memory.restore(self._loader, newest)
        if got is not None and not tried.skipped:
            tried.skipped.append(
                "no disk step" if newest is None else f"disk's newest: step {newest}"
            )
        return got

    def _try(self, s: int, tried: _Tried, *, requested: bool = False, where: str = "") -> bool:
        """Load step ``s`` (:meth:`.Loader.try_load`); True when applied. A step asked
        for by number raises instead of falling back."""
        why = self._loader.try_load(s)
        if why is None:
            return True
        tried.texts.append(f"step {s}{where}: {why.text}")
        # The WARNING above the restore line has the whole reason; the line keeps its kind.
        what = "refused by the live state" if why.refused else f"damaged ({_kind(why.text)})"
        tried.skipped.append(f"disk step {s}{where} is {what}")
        if why.refused:
            tried.refused.append((s, why.text))
        if requested and why.refused:
            raise RestoreRefused(refusal(s, why.text, self.store.root), s)
        if requested:
            raise CorruptCheckpoint(
                s, "damaged", f"the requested checkpoint failed verification ({why.text})"
            )
        return False

    def _from_archive(self, tried: _Tried) -> int | None:
        """Node replaced or disk lost: the newest remote copy that verifies and applies."""
        older: int | None = None
        while self._archive is not None:
            fetched: int | None = None
            failed: Exception | None = None
            if self._comm.rank == 0:
                from unbroken.ckpt.archive.remote import fetch_newest_valid

                try:
                    fetched = fetch_newest_valid(self._archive, self.store.root, older_than=older)
                except Exception as e:  # noqa: BLE001 - every rank raises it below
                    failed = e
            # the other ranks wait in this broadcast: rank 0's failure must reach them too
            fetched, why = self._comm.broadcast((fetched, None if failed is None else str(failed)))
            if failed is not None:
                raise failed
            if why is not None:
                raise RuntimeError(f"rank 0 could not fetch from the archive: {why}")
            if fetched is None:
                break
            if self._try(fetched, tried, where=f" (from {self._archive.url})"):
                return int(fetched)
            older = fetched
        return None

    def _nothing_restored(self, tried: _Tried) -> None:
        """No checkpoint applied: refuse (live refusals; files but nothing valid, unless
        ``allow_fresh_start``), or start fresh."""
        if tried.refused:  # the live objects refuse every checkpoint: theirs to fix, not damage
            s, why = tried.refused[0]
            raise RestoreRefused(refusal(s, why, self.store.root, len(tried.refused)), s)
        if self.store.has_foreign_content() and not self.config.allow_fresh_start:
            what = "; ".join(tried.texts) if tried.texts else "no step-N directory"
            if tried.moved:  # e.g. every step, by the attempt before this restart
                what += "; moved aside by an earlier restore: " + "; ".join(
                    f"step {s}: {why} ({name})" for name, s, why in tried.moved[-8:]
                )
            raise RuntimeError(
                f"{self.store.root!r} is not empty but holds no valid checkpoint (tried: "
                f"{what}); refusing to silently start from scratch. Pass "
                "allow_fresh_start=True to start anew, or point at another directory"
            )
        if tried.texts and self._comm.rank == 0:
            say(
                log, logging.WARNING,
                "no checkpoint in %s verified (%d tried); starting from scratch as "
                "allow_fresh_start=True asks",
                self.store.root, len(tried.texts), quiet=self.config.quiet,
            )  # fmt: skip
        elif self._memory is not None and self._memory.held_any and self._comm.rank == 0:
            # the memory tier held something it could not use (e.g. a node lost mid-transfer
            # of its replica): a fresh start past it is no silent one
            say(
                log, logging.WARNING,
                "starting from scratch: no disk step in %s and the %s",
                self.store.root, tried.line(), quiet=self.config.quiet,
            )  # fmt: skip
        for obj in self.state.components.values():  # a fresh start: e.g. MetricLog drops
            getattr(obj, "start_fresh", lambda: None)()  # what an earlier attempt logged

    def _restored(
        self,
        s: int,
        t0: float,
        refused: Sequence[tuple[int, str]] = (),
        *,
        tier: str = "disk",
        skipped: str = "",
    ) -> int:
        """After a restore: what the live state refused is damage, and ONE line names the
        tier, the step and why a newer tier was skipped (C-TIERS)."""
        for bad, why in refused:  # an older one applied: what the live state refused is damage
            self._loader.quarantine(bad, "refused", why, f"step {s} restored instead")
        dt = time.perf_counter() - t0
        self.last_restore_seconds = dt
        self._last_save_time = time.monotonic()
        self.restored_tier = tier
        if self._comm.rank == 0:
            created = self._loader.applied.created if self._loader.applied else None
            when = (
                time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(created))
                if isinstance(created, float | int)
                else "an unknown time"
            )
            why = f"; {skipped}" if skipped else ""
            say(
                log, logging.INFO, "resumed from step %d, saved at %s, in %.2f s, from the %s tier%s",
                s, when, dt, tier, printable(why), quiet=self.config.quiet,
            )  # fmt: skip
        _mark("loaded", step=s, seconds=dt, tier=tier)
        self._prepare_ahead()  # a resumed state is complete: the first save only copies
        return s


def _from_tier(memory: MemoryTier, step: int, tried: _Tried) -> dict[str, str]:
    """The restore line's tier and skipped copies for ``step`` taken from memory: ``peer
    replica`` when some rank's copy came from its peer, else ``memory``."""
    tier = "peer replica" if memory.via_peer == step else "memory"
    return {"tier": tier, "skipped": tried.line("memory")}


def _kind(text: str) -> str:
    """``bad-state`` of ``"bad-state: /path/...: detail"`` (a damage reason's code)."""
    head = text.split(":", 1)[0]
    return head if head and len(head) <= 40 and " " not in head else "see above"


class _StuckStep:
    """Warns once when :meth:`Checkpointer.maybe_save` sees the same step call after call:
    the loop's own counter is not reaching ``state.step`` (issue 21 item 3)."""

    CALLS = 5
    """calls at one step before the warning (a loop calls once per optimizer step)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.calls = 0
        self.warned = False

    def see(self, step: int) -> None:
        self.calls = self.calls + 1 if step == self.step else 1
        self.step = step
        if self.calls == self.CALLS and not self.warned:
            self.warned = True
            warnings.warn(
                f"Checkpointer.maybe_save() was called {self.calls} times at step {step}: the "
                f"step does not advance, so nothing after step {step} will be saved. Set "
                "state.step = <your loop's step counter> every step, or pass it: "
                "maybe_save(step)",
                stacklevel=3,
            )


@dataclass
class _Tried:
    """What one restore tried: a line per step, and the steps the live state refused."""

    texts: list[str] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    memory: str = ""  # why the memory tier was not used (C-TIERS), when it is on
    skipped: list[str] = field(default_factory=list)  # newer copies skipped, and why
    moved: list[tuple[str, int, str]] = field(default_factory=list)
    """Steps quarantined before this restore began: ``(name, step, reason)``."""

    def line(self, tier: str = "disk") -> str:
        """Why newer copies were skipped, for the one restore line (C-TIERS)."""
        if tier == "memory":
            return "; ".join([*self.skipped, *([f"skipped: {self.memory}"] if self.memory else [])])
        memory = [f"memory tier not used: {self.memory}"] if self.memory else []
        return "; ".join([*self.skipped, *memory])


class _WriterLock:
    """The root's one writer (C-ONE-WRITER, :mod:`.lock`): rank 0 holds the lease for the
    job; every rank knows whether it was taken for this checkpointer."""

    def __init__(self, store: Store, comm: Comm) -> None:
        self.store, self.comm = store, comm
        self.held = False
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def take(self, owner: Checkpointer, *, restoring: bool = False) -> None:
        """Become the root's one writer before the first restore or save; refuse (on every
        rank, with the holder named) when another live process is. Collective: rank 0
        holds the lock for the job. A non-collective checkpointer on rank > 0 of a job
        (rank 0 saves alone, everyone restores) takes it only when it saves."""
        if self.held:
            return
        if not self.comm.enabled and restoring and is_dist() and torch.distributed.get_rank() != 0:
            return
        err: BaseException | None = None
        lease: lock.Lease | None = None
        if self.comm.rank == 0:
            try:
                lease = lock.acquire(self.store.root)
            except Exception as e:  # noqa: BLE001 - RootLocked, not a dir, I/O: all ranks raise
                err = e
        err = self.comm.broadcast(err, allow=(lock.RootLocked,))
        if err is not None:
            raise err
        self.held = True
        if lease is not None:  # a checkpointer dropped without close() lets go too
            self._finalizer = weakref.finalize(owner, lease.release)

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # releases the lease once
            self._finalizer = None
        self.held = False


def _open_archive(cfg: ArchiveConfig | None) -> tuple[Any, Any]:
    """The remote archive and its background uploader (the object-store layer: imported only when used)."""
    if cfg is None:
        return None, None
    from unbroken.ckpt.archive.remote import Archive
    from unbroken.ckpt.archive.uploader import BackgroundUploader

    archive = Archive(cfg)
    return archive, BackgroundUploader(archive)


def _close_memory(memory: MemoryTier, store: Store, *, crashed: bool = False) -> None:
    steps = store.steps()
    memory.close(steps[-1] if steps else None, crashed=crashed)


def _dying_of_an_exception() -> bool:
    """At interpreter exit: whether the main thread ended on an unhandled exception (the
    interpreter sets ``sys.last_exc`` / ``sys.last_value`` as it prints the traceback)."""
    return any(getattr(sys, n, None) is not None for n in ("last_exc", "last_value"))


def _flush_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    ckpt = ref()
    if ckpt is not None:
        ckpt._flush_quietly()
