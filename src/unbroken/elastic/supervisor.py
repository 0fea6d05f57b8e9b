"""`unbroken run`: keep a torchrun job alive unattended.

One supervisor runs per node. Each attempt is a child ``torchrun`` (elastic agent, c10d
rendezvous, ``--nnodes MIN:MAX``, ``--max-restarts 0``, see ``launch.attempt``) on a
rendezvous store the supervisor hosts or joins (see ``rendezvous``). Around it the
supervisor adds pre-flight before every start (``preflight``), a hang watchdog with stack
dumps (``heartbeat``), classification of every failure and a restart policy (``faults``,
E-CLASSIFY), and the four recovery phases of each failure in ``RUN_DIR/events.jsonl``, a
per-failure ``RUN_DIR/recovery.jsonl`` and a summary table (``recovery``, E-MEASURED).

Exit codes (:mod:`unbroken.elastic.faults`, ``EXIT_*``): 0 finished, 1 supervisor error,
2 usage, 3 same failure twice (deterministic bug), 4 restart budget used up, 5 no progress,
6 pre-flight never healthy, 7 preempted (SIGTERM/SIGINT; the job was asked to save), 8 the
checkpoint refused the job's configuration at restore (a configuration fault: not retried).

Why recovery is fast (launcher exit reports, pidfds, ``stop_grace``, the standby agent):
ARCHITECTURE.md, "Design notes" > elastic > the supervisor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from unbroken.common import events, memdir
from unbroken.common.events import load_events
from unbroken.common.fs import atomic_write_bytes, private_dir
from unbroken.common.procs import is_alive, proc_state, signal_name
from unbroken.elastic import faults, heartbeat, recovery
from unbroken.elastic.faults import Action, Classification, Evidence, FaultClass, RestartPolicy
from unbroken.elastic.launch.attempt import DEFAULT_PRELOAD, ENV_TOKEN, Attempt, worker_command
from unbroken.elastic.launch.standby import Standby
from unbroken.elastic.preflight import CheckResult, PreflightConfig, wait_until_healthy
from unbroken.elastic.rendezvous import Coordinator, RendezvousConfig

__all__ = [
    "RunConfig",
    "Supervisor",
    "WatchdogConfig",
    "require_script",
    "run",
]

log = logging.getLogger(__name__)

STANDBY_STARTS = ("auto", "launch", "beat")
"""The values of ``RunConfig.standby_start``."""


@dataclass(frozen=True)
class WatchdogConfig:
    """The hang watchdog over the workers' progress beats (``unbroken run --hang-timeout``)."""

    hang_timeout: float = 300.0
    """Seconds without a beat from a live worker before the group is declared hung. Must
    exceed the longest step, blocking save or evaluation between two beats."""
    startup_timeout: float = 900.0
    """Seconds a worker may stay between ``heartbeat.install()`` and its first beat."""
    poll_interval: float = 0.5
    """How often the supervisor looks at torchrun, the beats and the store (seconds)."""
    dump_grace: float = 3.0
    """Seconds hung workers get to write their stack dumps before the SIGKILL."""

    def __post_init__(self) -> None:
        if self.poll_interval <= 0 or self.hang_timeout <= 2 * self.poll_interval:
            raise ValueError(
                f"hang_timeout={self.hang_timeout} must exceed 2 x poll_interval="
                f"{self.poll_interval} (> 0); raise --hang-timeout or lower --poll-interval"
            )
        if self.startup_timeout <= 0 or self.dump_grace < 0:
            raise ValueError(
                f"startup_timeout={self.startup_timeout} must be > 0 and "
                f"dump_grace={self.dump_grace} >= 0"
            )


@dataclass(frozen=True)
class RunConfig:
    """Everything ``unbroken run`` does, one field per flag; the single source of its defaults
    (the CLI reads them from here)."""

    command: tuple[str, ...]
    """Training script and its arguments (a module name and arguments with ``module``)."""
    run_dir: str = "unbroken-run"
    """Holds events.jsonl, recovery.jsonl, the attempts' logs, beats and stack dumps."""
    nproc_per_node: int = 1
    """Worker processes per node (torchrun's ``--nproc-per-node``)."""
    module: bool = False
    """``command[0]`` is a module name (``python -m``), not a script path."""
    rdzv: RendezvousConfig = field(default_factory=RendezvousConfig)
    """Rendezvous of the nodes."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Hang detection."""
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    """When to restart, how long to wait, when to give up."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    """Checks before the first start and before every restart."""
    preflight_max_wait: float = 3600.0
    """Seconds to keep waiting for a healthy pre-flight before exiting with code 6."""
    shutdown_timeout: float = 30.0
    """On SIGTERM: seconds the workers get to save before they are killed. Also the finish
    timeout: seconds a worker that said its loop ended (``finishing()``, or its interpreter
    exiting) gets to save and exit before it is a hang (at least ``hang_timeout``)."""
    stop_grace: float = 1.0
    """When a rank failed: seconds the other ranks get to exit after SIGTERM before they
    are SIGKILLed. They cannot finish a collective with the dead rank (a rank stuck in one
    does not even run its SIGTERM handler), so this only bounds a flush of local state."""
    prewarm: bool = True
    """Fork the workers from the standby's fork server, which imported ``preload`` ahead
    (see ``launch.standby``). False holds only a bare agent ahead (torch and torchrun
    imported, no fork server) that forks its fork server when it takes over, at the
    restart: the workers are forked from its imported torch instead of each importing it
    (issue 23 item 2), and nothing more is held while the job trains."""
    standby: bool = True
    """Keep the next attempt's torchrun agent started ahead, torch imported (with
    ``prewarm``: and its fork server). False holds nothing ahead while the job trains (no
    memory, no CPU) and starts fresh worker interpreters: a rank's failure restarts them in
    the running agent (as torchrun does), the loss of the agent costs a fresh one."""
    standby_start: str = "auto"
    """When the next attempt's standby starts: ``launch`` (with the attempt, ready soonest),
    ``beat`` (once every local rank has beaten: its imports never compete with the
    attempt's own start-up), ``auto``: ``launch`` when the node has a CPU for each local
    rank, the attempt's agent and fork server and the standby's two (``nproc + 4``), else
    ``beat`` (issue 23 item 1: measured in benchmarks/RESULTS.md)."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules the pre-warmed agent imports before forking workers (add your heavy imports:
    they are then free at every restart). A module that fails to import is skipped."""
    rules: tuple[faults.Rule, ...] = faults.DEFAULT_RULES
    """Failure classification rules, first match wins (yours before the built-in table)."""
    torchrun_args: tuple[str, ...] = ()
    """Extra arguments passed to torchrun as they are."""
    echo: bool = True
    """Copy torchrun's console to this process's stdout."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no training command: use `unbroken run [options] -- train.py ARGS`")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={self.nproc_per_node} must be >= 1")
        if self.standby_start not in STANDBY_STARTS:
            raise ValueError(
                f"standby_start={self.standby_start!r} (--standby-start) is not one of "
                f"{', '.join(STANDBY_STARTS)}"
            )
        for name in ("preflight_max_wait", "shutdown_timeout", "stop_grace"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is negative; pass seconds >= 0")


def require_script(command: Sequence[str], module: bool, verb: str = "run") -> None:
    """Refuse a training script that does not exist, before any process starts (torchrun
    would start, fail, and the restart policy would try again). ``verb`` names the command
    in the fix (``run`` or ``drill``)."""
    if command and not module and _interpreter(command[0]):
        rest = " ".join(command[1:2]) or "SCRIPT"
        raise ValueError(
            f"{command[0]}: a program, not a Python script: unbroken {verb} starts the "
            f"script with Python itself, as torchrun does; use `unbroken {verb} [options] -- "
            f"{rest} ARGS` (-m for a module name)"
        )
    if command and not module and not os.path.isfile(command[0]):
        raise FileNotFoundError(
            f"{command[0]}: training script not found; use `unbroken {verb} [options] -- "
            "SCRIPT ARGS` with the path of a Python script, or -m for a module name"
        )


def _interpreter(path: str) -> bool:
    """``path`` names a Python interpreter (``python``, ``python3.11``, a venv's) or is a
    compiled program (an ELF file), not a script: torchrun would run it as Python source."""
    if re.fullmatch(r"python[0-9.]*", os.path.basename(path)):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


@dataclass
class _Outcome:
    kind: str  # success | exit | agent_lost | hang | peer | preempted | stopped
    rc: int | None = None
    t_fail: float = 0.0
    t_detect: float = 0.0
    detail: str = ""
    stop: tuple[int, str] | None = None
    step: int | None = None
    """The step the failure is filed under, when fixed at detection (hangs)."""


@dataclass
class _Watch:
    """What the watch loop carries from one poll to the next."""

    t_up: float | None = None
    """When the attempt's first workers appeared."""
    store_lost: float | None = None
    """Since when the rendezvous store has been unreachable."""
    warned: bool = False
    installed: dict[str, float] = field(default_factory=dict)
    """Beacon -> when first seen (workers may restart)."""
    owned: set[int] = field(default_factory=set)
    """Worker pids seen alive carrying the attempt's token (a dead beacon counts only then)."""
    gone: dict[int, float] = field(default_factory=dict)
    """Such a worker -> when it was first seen gone while its launcher lived, unreported."""
    membership: tuple[int, set[int]] | None = None
    """After a membership change: (the step reached before it, the old workers' pids)
    until a new worker beats that step (``membership_caught_up``)."""


class Supervisor:
    """Runs :class:`RunConfig`'s command until it finishes or the policy gives up."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.node = cfg.rdzv.node or f"{socket.gethostname()}-{os.getpid()}"
        self.tracker = faults.RestartTracker(cfg.policy)
        self._signal: int | None = None
        self._attempt: Attempt | None = None
        self._max_step = -1
        self._t_start = time.time()  # events from here on are this run's (a rerun appends)
        self._coord: Coordinator | None = None
        self._failures: list[tuple[int, faults.Evidence, Classification]] = []
        self._preflight_ok_at = float("-inf")
        self._standby: Standby | None = None
        self._memory: str | None = None  # the memory tier's directory, when this agent owns it
        self._kept: Standby | None = None
        """The last attempt's agent, kept for the next one (see ``_agent_for``)."""
        self._at_launch = self._standby_at_launch()

    # --- bookkeeping ---------------------------------------------------------------------

    def _event(self, name: str, **fields: Any) -> None:
        rec: dict[str, Any] = {
            "t": time.time(),
            "event": name,
            "pid": os.getpid(),
            "node": self.node,
        }
        rec.update(fields)
        events.append_event(self.run_dir, rec)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self._signal is not None and self._attempt is not None:
            self._attempt.kill()  # second signal: stop waiting for the job to save
        self._signal = signum

    def _progress(self) -> int | None:
        """The checkpointed step as the job reported it (``saved``/``loaded``), else the
        highest step any attempt reached."""
        steps = [
            e["step"]
            for e in load_events(self.run_dir)
            if e["event"] in ("saved", "loaded") and type(e.get("step")) is int
        ]
        if steps:
            return max(steps)
        return self._max_step if self._max_step >= 0 else None

    def _preflight_cfg(self, coord: Coordinator) -> PreflightConfig:
        p = self.cfg.preflight
        endpoint = None if coord.hosting else coord.endpoint
        return PreflightConfig(
            p.ckpt_dir,
            p.data,
            p.min_free_bytes,
            endpoint,
            p.gpus if p.gpus is not None else self.cfg.nproc_per_node,
            p.gpu_min_free_fraction,
            p.timeout,
            p.node or self.node,
            saved=any(
                e["event"] == "saved" and e["t"] >= self._t_start for e in load_events(self.run_dir)
            ),
        )

    def _preflight(self, coord: Coordinator, *, wait: bool) -> tuple[bool, list[CheckResult]]:
        def record(res: list[CheckResult], waited: float) -> None:
            self._event(
                "preflight",
                ok=all(r.ok for r in res),
                waited=round(waited, 3),
                checks=[
                    {"name": r.name, "ok": r.ok, "detail": r.detail, "seconds": round(r.seconds, 3)}
                    for r in res
                    if not r.skipped
                ],
            )

        def stop() -> bool:
            self._tick(coord)
            return self._signal is not None or self._peer_stop(coord) is not None

        ok, res = wait_until_healthy(
            self._preflight_cfg(coord),
            max_wait=self.cfg.preflight_max_wait if wait else 0.0,
            initial_delay=min(1.0, max(0.1, self.cfg.policy.backoff_initial)),
            on_result=record,
            should_stop=stop,
        )
        self._preflight_ok_at = time.monotonic() if ok else float("-inf")
        return ok, res

    def _tick(self, coord: Coordinator) -> None:
        try:
            coord.tick()
        except RuntimeError as e:
            raise RuntimeError(f"lost the rendezvous store at {coord.endpoint}: {e}") from e

    def _peer_stop(self, coord: Coordinator) -> tuple[int, str] | None:
        try:
            return coord.get_stop()
        except RuntimeError:
            return None

    # --- one attempt ---------------------------------------------------------------------

    def _torchrun_argv(self, coord: Coordinator, gen: int) -> list[str]:
        c, r = self.cfg, self.cfg.rdzv
        conf = (
            f"is_host=false,last_call_timeout={r.last_call_timeout:g},"
            f"join_timeout={r.join_timeout:g}"
        )
        argv = [
            "--nnodes",
            r.nnodes,
            "--nproc-per-node",
            str(c.nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            coord.endpoint,
            "--rdzv-id",
            f"{r.run_id}-g{gen}",
            "--rdzv-conf",
            conf,
            "--max-restarts",
            "0",
            "--monitor-interval",
            f"{min(0.1, c.watchdog.poll_interval):g}",
            "--tee",
            "3",
            *c.torchrun_args,
        ]
        return [*argv, *worker_command(c.command, c.module, c.torchrun_args)]

    def _new_standby(self, number: int) -> Standby:
        return Standby(
            number=number,
            run_dir=self.run_dir,
            nproc=self.cfg.nproc_per_node,
            preload=self.cfg.preload,
            echo=self.cfg.echo,
            fork_server=self.cfg.prewarm and self.cfg.standby,
            on_demand=not self.cfg.prewarm and self.cfg.standby,
        )

    def _standby_at_launch(self) -> bool:
        """Start the next attempt's standby with the attempt (``RunConfig.standby_start``)."""
        if self.cfg.standby_start != "auto":
            return self.cfg.standby_start == "launch"
        return len(os.sched_getaffinity(0)) >= self.cfg.nproc_per_node + 4

    def _agent_for(self, number: int) -> tuple[Standby | None, list[Standby]]:
        """The agent for attempt ``number`` and the ones not taken (closed once the attempt
        is launched: their teardown stays off the restart's path). The standby if its
        imports are done; else the last attempt's agent if it was kept (issue 23: warm, only
        the workers restart; a standby still importing would put its imports on the
        restart's path); else the standby as it is; else a cold one (with
        ``standby=False``: the attempt's own agent, bare, that is kept the same way)."""
        sb, self._standby = self._standby, None
        kept, self._kept = self._kept, None
        drop: list[Standby] = []
        if sb is not None and (sb.number != number or not sb.alive()):
            drop.append(sb)
            sb = None
        if kept is not None and sb is not None and sb.ready():
            drop.append(kept)  # a fresh agent: nothing of the failed one carries over
            kept = None
        if kept is not None and kept.reuse(number):
            return kept, [*drop, *([sb] if sb is not None else [])]
        if kept is not None:
            drop.append(kept)
        if sb is None:  # cold (standby=False: the attempt's own agent, kept on a rank's failure)
            sb = self._new_standby(number)
        return sb, drop

    def _launch(self, coord: Coordinator, number: int, gen: int) -> Attempt:
        target = self._max_step if self._failures and self._max_step >= 0 else None
        sb, drop = self._agent_for(number)
        att = Attempt(
            number=number,
            gen=gen,
            run_dir=self.run_dir,
            torchrun_argv=self._torchrun_argv(coord, gen),
            catchup_step=target,
            echo=self.cfg.echo,
            nproc=self.cfg.nproc_per_node,
            standby=sb,
        )
        self._attempt = att
        for other in drop:
            other.close()
        self._event(
            "launch",
            attempt=number,
            gen=gen,
            catchup_step=target,
            argv=att.argv,
            agent_pid=att.proc.pid,
            prewarmed=att.prewarmed,
            kept=att.kept,
        )
        log.info("attempt %d (generation %d) started: %s", number, gen, " ".join(att.argv))
        return att

    def _maybe_prewarm(
        self, att: Attempt, beats: list[heartbeat.BeatRecord], t_up: float | None, now: float
    ) -> None:
        """Start the next attempt's standby: with the attempt when the node has a CPU for
        it (``_standby_at_launch``), else once this attempt trains (every local rank beat,
        or 30 s after its workers appeared), so that its imports do not slow this attempt's
        start-up (issue 23 item 1)."""
        if not self.cfg.standby or self._standby is not None:
            return
        if self._at_launch or (
            t_up is not None
            and (
                len({b.rank for b in beats if b.started}) >= self.cfg.nproc_per_node
                or now - t_up > 30.0
            )
        ):
            self._standby = self._new_standby(att.number + 1)

    def _monitor(self, att: Attempt, coord: Coordinator) -> _Outcome:
        w = self.cfg.watchdog
        st = _Watch()
        while True:
            rc = att.poll()
            now = time.time()
            if rc is not None:
                return self._ended(att, rc, now)
            if self._signal is not None:
                return self._preempt(att)
            news = self._store_news(att, coord, st, now)
            if news is not None:
                return news
            beats = heartbeat.read_beats(self.run_dir, att.number)
            # A beacon's pid counts (liveness, hangs, stops) only for this attempt's processes.
            mine = [b for b in beats if att.owns(b.pid)]
            pids = set(att.worker_pids()) | {b.pid for b in mine}
            if pids and st.t_up is None:
                st.t_up = now
                self._event("workers_up", attempt=att.number, pids=sorted(pids))
            failed = att.failure()
            if failed is not None:
                return self._stop_group(att, failed, mine)
            ended = att.ranks_ended()
            if ended is not None and now - ended > self._agent_limit():
                return self._agent_outlived(att, ended, now)
            self._membership(att, beats, mine, st)
            for b in beats:
                self._max_step = max(self._max_step, b.step)
            self._maybe_prewarm(att, mine, st.t_up, now)
            self._warn_without_beats(beats, st, now)
            hung = self._hung(mine, st, now)
            if hung:
                return self._hang(att, mine, hung, now)
            unreported = self._unreported(att, beats, mine, st, now)
            if unreported:
                return self._hang(att, mine, unreported, now, gone=True)
            # Until the workers exist, look often: workers_up ends the relaunch phase (and
            # the new workers' appearance ends a membership change's).
            up = st.t_up is not None and not att.restarting()
            att.wait(pids, w.poll_interval if up else min(w.poll_interval, 0.05))

    def _membership(
        self,
        att: Attempt,
        beats: list[heartbeat.BeatRecord],
        mine: list[heartbeat.BeatRecord],
        st: _Watch,
    ) -> None:
        """torchrun restarted the workers to admit a joining node (issue 23): a membership
        change, not a failure (no restart counted, no classification); its own event, and
        ``membership_caught_up`` once a new worker is back at the step reached before it."""
        change = att.membership_change()
        if change is not None:
            t_stop, t_seen, t_up = change
            old = {b.pid for b in beats if b.pid not in {m.pid for m in mine}}
            step = max((b.step for b in beats if b.pid in old), default=-1)
            reason = (
                "torchrun restarted the workers to admit a node that joined the rendezvous "
                "(a membership change: not a failure, no restart counted)"
            )
            self._event(
                "membership",
                attempt=att.number,
                gen=att.gen,
                change="scale_up",
                t_fail=t_stop,
                t_detect=t_seen,
                t_up=t_up,
                step=step if step >= 0 else None,
                reason=reason,
                restarts=self.tracker.restarts,
            )
            log.warning(
                "attempt %d: %s; new workers up %.2f s after the stop",
                att.number,
                reason,
                t_up - t_stop,
            )
            st.membership = (step, old) if step >= 0 else None
        if st.membership is not None:
            step, old = st.membership
            back = [b for b in mine if b.pid not in old and b.step >= step]
            if back:
                self._event(
                    "membership_caught_up", attempt=att.number, step=step, rank=back[0].rank
                )
                st.membership = None

    def _ended(self, att: Attempt, rc: int, now: float) -> _Outcome:
        """The agent exited with ``rc``."""
        if rc == 0:
            return _Outcome("success", 0)
        kind = "agent_lost" if rc < 0 else "exit"
        detail = f"torchrun killed by {signal_name(-rc)}" if rc < 0 else ""
        first = att.failure()
        # The failure happened when the first rank failed; torchrun's teardown of the others
        # (and its exit) is already part of the relaunch.
        return _Outcome(kind, rc, first.t if first else now, now, detail)

    def _agent_limit(self) -> float:
        """Seconds the agent may outlive all its ranks: the finish timeout, and on several
        nodes at least torchrun's exit barrier (its agent waits there for the others)."""
        limit = max(self.cfg.watchdog.hang_timeout, self.cfg.shutdown_timeout)
        return max(limit, _EXIT_BARRIER) if self.cfg.rdzv.bounds[1] > 1 else limit

    def _agent_outlived(self, att: Attempt, ended: float, now: float) -> _Outcome:
        """Every rank of the node ended but the agent did not exit (stopped, or wedged in
        its teardown): it can no longer do anything for the job, and nothing else would
        end the run (no worker beacon is live). End it; the attempt ended as its ranks did."""
        state = proc_state(att.proc.pid)
        how = " (stopped: SIGSTOP)" if state in ("T", "t") else ""
        detail = (
            f"the torchrun agent (pid {att.proc.pid}){how} has not exited {now - ended:.1f} s "
            f"after its ranks ended (--shutdown-timeout, at least --hang-timeout: "
            f"{self._agent_limit():g} s); ended it"
        )
        log.warning("attempt %d: %s", att.number, detail)
        att.kill()
        clean = all(x.exitcode == 0 for x in att.exits)
        out = self._ended(att, 0 if clean else 1, now)
        out.detail = out.detail or detail
        return out

    def _store_news(
        self, att: Attempt, coord: Coordinator, st: _Watch, now: float
    ) -> _Outcome | None:
        """Tick; another node stopped the job, or moved to a newer generation."""
        try:
            coord.tick()
            stop = coord.get_stop()
            newer = coord.gen() > att.gen
            st.store_lost = None
        except RuntimeError as e:
            # The store host may be finishing a moment before us; only a lasting loss is
            # fatal (torchrun's own rendezvous keep-alives fail soon after anyway).
            st.store_lost = st.store_lost or now
            if now - st.store_lost > 2 * self.cfg.rdzv.node_timeout:
                att.kill()
                raise RuntimeError(f"lost the rendezvous store at {coord.endpoint}: {e}") from e
            return None
        if stop is not None:
            att.kill()
            return _Outcome("stopped", None, now, now, stop=stop)
        if newer:
            att.kill()
            return _Outcome("peer", None, now, now, "another node failed; joining its restart")
        return None

    def _warn_without_beats(
        self, beats: list[heartbeat.BeatRecord], st: _Watch, now: float
    ) -> None:
        if beats or st.t_up is None or st.warned or now - st.t_up <= self.cfg.watchdog.hang_timeout:
            return
        st.warned = True
        log.warning(
            "no heartbeat from the workers after %.0f s: call unbroken.elastic.beat(step) "
            "every step to enable hang detection and catch-up measurement",
            now - st.t_up,
        )

    def _hung(
        self, mine: list[heartbeat.BeatRecord], st: _Watch, now: float
    ) -> list[heartbeat.BeatRecord]:
        """Live workers without a beat for ``hang_timeout`` s, or stuck before their first
        beat for ``startup_timeout`` s."""
        w = self.cfg.watchdog
        for b in mine:
            st.installed.setdefault(b.path, now)
        hung = heartbeat.stalled(mine, now, w.hang_timeout, self.cfg.shutdown_timeout)
        if hung:
            return hung
        return [b for b in mine if not b.started and now - st.installed[b.path] > w.startup_timeout]

    def _unreported(
        self,
        att: Attempt,
        beats: list[heartbeat.BeatRecord],
        mine: list[heartbeat.BeatRecord],
        st: _Watch,
        now: float,
    ) -> list[heartbeat.BeatRecord]:
        """Workers of this attempt gone for ``hang_timeout`` s while their launcher lives
        and never reported it (a stopped launcher: torchrun waits on it, and a dead beacon
        is no hang to ``stalled``). Only pids seen alive with the attempt's token count."""
        st.owned.update(b.pid for b in mine)
        reported = {x.pid for x in att.exits}
        waiting = att.launcher_workers()
        out = []
        for b in beats:
            if b.pid not in st.owned or b.pid not in waiting or b.pid in reported:
                continue
            if is_alive(b.pid):
                continue
            if now - st.gone.setdefault(b.pid, now) > self.cfg.watchdog.hang_timeout:
                out.append(b)
        return out

    def _stop_group(
        self, att: Attempt, failed: faults.WorkerExit, beats: list[heartbeat.BeatRecord]
    ) -> _Outcome:
        """A rank failed: stop the rest now instead of waiting on them (see module doc)."""
        t_detect = time.time()
        reason = failed.describe()
        exited, killed, took = att.stop_workers(
            reason, self.cfg.stop_grace, {b.pid: b.rank for b in beats}
        )
        self._event(
            "stop_group",
            attempt=att.number,
            reason=reason,
            t_fail=failed.t,
            grace=self.cfg.stop_grace,
            seconds=round(took, 3),
            exited=exited,
            killed=killed,
        )
        log.warning(
            "attempt %d: %s; stopped the other ranks in %.2f s%s",
            att.number,
            reason,
            took,
            f" (SIGKILLed after {self.cfg.stop_grace:g} s: ranks {killed})" if killed else "",
        )
        return _Outcome("exit", att.poll(), min(failed.t, t_detect), t_detect)

    def _hang(
        self,
        att: Attempt,
        beats: list[heartbeat.BeatRecord],
        hung: list[heartbeat.BeatRecord],
        now: float,
        gone: bool = False,
    ) -> _Outcome:
        """``gone``: the ``hung`` workers ended, but their launchers never reported it."""
        began = heartbeat.hang_began(beats, hung)
        t_fail = began if began is not None else att.t_launch
        ranks = sorted({b.rank for b in hung})
        # The step is fixed now: a SIGSTOPped rank resumed for its stack dump may still beat
        # once before the kill, and the table must say what the message says.
        step = max((b.step for b in (*beats, *hung)), default=-1)  # hung: may be gone (``gone``)
        stacks = heartbeat.request_stack_dumps(
            self.run_dir, beats, self.cfg.watchdog.dump_grace, (ENV_TOKEN, att.token)
        )
        if gone:
            detail = (
                f"ranks {ranks}: the worker ended and its launcher (the process torchrun "
                f"started, stopped or wedged) has not reported it for "
                f"{self.cfg.watchdog.hang_timeout:g} s (--hang-timeout) at step {step}"
            )
        elif all(b.finished for b in hung):
            limit = max(self.cfg.watchdog.hang_timeout, self.cfg.shutdown_timeout)
            detail = (
                f"ranks {ranks} said their loop ended and have not exited for "
                f"{now - t_fail:.1f} s (--shutdown-timeout, at least --hang-timeout: "
                f"{limit:g} s) at step {step}"
            )
        else:
            detail = (
                f"ranks {ranks} made no progress for {now - t_fail:.1f} s "
                f"(--hang-timeout {self.cfg.watchdog.hang_timeout:g} s) at step {step}"
            )
        self._event(
            "hang",
            attempt=att.number,
            ranks=ranks,
            stacks=stacks,
            detail=detail,
            t_detect=now,
            step=step,
        )
        log.error("attempt %d hung: %s; stack dumps: %s", att.number, detail, stacks or "none")
        att.kill()
        return _Outcome("hang", None, t_fail, now, detail, step=step if step >= 0 else None)

    def _preempt(self, att: Attempt) -> _Outcome:
        now = time.time()
        log.warning(
            "%s received: asking the job to save and stop (up to %g s)",
            signal_name(self._signal or signal.SIGTERM),
            self.cfg.shutdown_timeout,
        )
        rc = att.terminate(self.cfg.shutdown_timeout + 5.0)
        att.kill()
        return _Outcome("preempted", rc, now, now, f"{signal_name(self._signal or 15)} received")

    # --- failures ------------------------------------------------------------------------

    def _evidence(self, att: Attempt, out: _Outcome) -> Evidence:
        console = att.console()
        fails: tuple[faults.WorkerFailure, ...] = ()
        if out.kind in ("exit", "agent_lost"):
            fails = tuple(faults.collect_worker_failures(console, att.log_dir, att.exits))
        step = out.step
        if step is None:
            last = max((b.step for b in heartbeat.read_beats(self.run_dir, att.number)), default=-1)
            step = last if last >= 0 else None
        if step is not None:  # a rank may have beaten once more after the last poll
            self._max_step = max(self._max_step, step)
        return Evidence(out.kind, out.rc, fails, console[-8000:], step, out.detail)

    def _lost_peers(self, coord: Coordinator, t_fail: float) -> list[str]:
        """Peers whose supervisors went silent around the failure (waits up to node_timeout)."""
        deadline = t_fail + self.cfg.rdzv.node_timeout
        while True:
            self._tick(coord)
            peers = coord.peers()
            if all(t > t_fail for t in peers.values()):
                return []
            if time.time() >= deadline:
                return sorted(n for n, t in peers.items() if t <= t_fail)
            time.sleep(min(0.2, self.cfg.watchdog.poll_interval))

    def _handle_failure(self, coord: Coordinator, att: Attempt, out: _Outcome) -> int | None:
        """Classify, record, decide; returns an exit code or None to restart."""
        ev = self._evidence(att, out)
        c = self._classify(coord, ev, out)
        d = self.tracker.decide(c, self._progress(), ev.step)
        self._failures.append((att.number, ev, c))
        self._record_failure(att, out, ev, c, d)
        if d.exit_code is not None:
            if d.action is Action.STOP:
                self._write_stop_report(d)
                with contextlib.suppress(RuntimeError):
                    coord.set_stop(d.exit_code, d.reason)
            return d.exit_code
        self._sleep(d.delay, coord)
        return None

    def _classify(self, coord: Coordinator, ev: Evidence, out: _Outcome) -> Classification:
        """The rules' verdict, turned into a lost node when a peer supervisor went silent
        around a process fault, or into a storage fault when pre-flight now fails."""
        c = faults.classify(ev, self.cfg.rules)
        if self.cfg.rdzv.bounds[1] > 1 and c.fault is FaultClass.PROCESS and out.kind != "hang":
            lost = self._lost_peers(coord, out.t_fail)
            if lost:
                why = f"node(s) {', '.join(lost)} lost; continuing within --nnodes {self.cfg.rdzv.nnodes}"
                c = Classification(
                    FaultClass.NODE_LOST, Action.WAIT_FOR_NODES, "node_lost", why, None, True
                )
        if c.action is not Action.EXIT:
            _ok, res = self._preflight(coord, wait=False)
            bad = [r for r in res if not r.ok and r.name in ("ckpt_dir", "data")]
            if bad:
                why = "; ".join(f"{r.name}: {r.detail}" for r in bad)
                c = Classification(
                    FaultClass.STORAGE, Action.PREFLIGHT, "preflight", why, None, True
                )
        return c

    def _record_failure(
        self, att: Attempt, out: _Outcome, ev: Evidence, c: Classification, d: faults.Decision
    ) -> None:
        """The ``failure`` event, ``supervisor.json`` (the restart bookkeeping), a log line."""
        self._event(
            "failure",
            attempt=att.number,
            gen=att.gen,
            kind=out.kind,
            t_fail=out.t_fail,
            t_detect=out.t_detect,
            exit_code=out.rc,
            fault=(d.fault or c.fault).value,
            rule=c.rule,
            action=d.action.value,
            reason=d.reason or c.reason,
            signature=c.signature,
            step=ev.step,
            delay=d.delay,
            restarts=self.tracker.restarts,
            stop_code=d.exit_code,
        )
        atomic_write_bytes(
            os.path.join(self.run_dir, "supervisor.json"),
            json.dumps(self.tracker.state_dict(), indent=1).encode(),
            mode=events.FILE_MODE,
        )
        log.warning(
            "attempt %d failed: %s [%s -> %s] %s",
            att.number,
            out.kind,
            c.fault.value,
            d.action.value,
            d.reason or c.reason,
        )

    def _sleep(self, seconds: float, coord: Coordinator) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and self._signal is None:
            self._tick(coord)
            time.sleep(min(self.cfg.watchdog.poll_interval, max(0.0, end - time.monotonic())))

    def _write_stop_report(self, d: faults.Decision) -> None:
        lines = [
            f"unbroken run stopped: {d.reason}",
            f"exit code {d.exit_code}; run directory {self.run_dir}",
            "",
            "failures:",
        ]
        for n, ev, c in self._failures:
            lines.append(f"  attempt {n}: step {ev.step}: [{c.fault.value}/{c.rule}] {c.reason}")
        n, ev, c = self._failures[-1]
        if ev.failures:
            f = ev.failures[0]
            lines += [
                "",
                f"last failure, rank {f.rank} (attempt {n}):",
                # an exit code of its own may be all there is (sys.exit(3): no output)
                (f.traceback or f.stderr_tail or f.message or c.reason).rstrip()[-4000:],
            ]
        lines += [
            "",
            f"logs: {os.path.join(self.run_dir, 'attempts', str(n))}",
            "Fix the cause, then rerun the same command: it resumes from the newest checkpoint.",
        ]
        text = "\n".join(lines) + "\n"
        atomic_write_bytes(
            os.path.join(self.run_dir, "stop-report.txt"), text.encode(), mode=events.FILE_MODE
        )
        print(text, flush=True)

    # --- main loop -----------------------------------------------------------------------

    def run(self) -> int:
        # The log records argv and tracebacks, and the run's files steer signals (beacons):
        # refused unless private to this user (PrivateDirError names the directory and fix).
        private_dir(self.run_dir, purpose="run directory")
        first = 1 + max(
            (
                e["attempt"]
                for e in load_events(self.run_dir)
                if e["event"] == "launch" and type(e.get("attempt")) is int
            ),
            default=-1,
        )
        code = faults.EXIT_ERROR
        env_before = os.environ.get(memdir.ENV)
        old = {}
        if threading.current_thread() is threading.main_thread():
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            tier = self._own_memory_tier()
            # The first attempt's agent starts now (it inherits the memory tier named above):
            # its imports (torch, torchrun, the workers' preloads) run while this process
            # imports torch for the store and runs the pre-flight checks. It waits for its
            # order (`_launch`); a start that fails before it closes it (`finally`).
            self._standby = self._new_standby(first)
            r = self.cfg.rdzv
            host, _, port = r.endpoint.rpartition(":")
            self._coord = Coordinator(
                host,
                int(port),
                r.run_id,
                self.node,
                connect_timeout=r.join_timeout,
                # a store silent this long is lost (the monitor tolerates a loss as long
                # again before it gives up: `_store_news`)
                call_timeout=2 * r.node_timeout,
                multi_node=r.bounds[1] > 1,
            )
            self._event(
                "start",
                node=self.node,
                store=self._coord.endpoint,
                hosting=self._coord.hosting,
                command=list(self.cfg.command),
                nnodes=r.nnodes,
                nproc_per_node=self.cfg.nproc_per_node,
                memory_tier=tier,
            )
            code = self._loop(self._coord, first)
        except RuntimeError as e:
            log.error("supervisor failed: %s", e)
            code = faults.EXIT_ERROR
        finally:
            if self._attempt is not None:
                self._attempt.close()
                heartbeat.remove_empty_dumps(self.run_dir, self._attempt.number)
            for sb in (self._standby, self._kept):
                if sb is not None:
                    sb.close()
            self._standby = self._kept = None
            for s, h in old.items():
                signal.signal(s, h)
            self._drop_memory_tier(env_before)
            self._event("finish" if code == 0 else "stop", exit_code=code)
            self._finish()
            if self._coord is not None:
                self._release_store(self._coord, code)
        return code

    def _own_memory_tier(self) -> str | None:
        """Create the job's private memory-tier directory on this node and name it to the
        workers (every process started from here inherits the environment) as removed by
        this agent when the job ends (:func:`~unbroken.common.memdir.agent_removes`: the
        workers keep their slots however they end); a crashed worker's slots wait there for
        its successor (issue 25). A directory the user named
        (``$UNBROKEN_MEMORY_TIER``) is used as given and never removed. Returns the path."""
        given = os.environ.get(memdir.ENV)
        if given:
            return given
        path = memdir.job_dir(f"unbroken run {self.run_dir} {self.cfg.rdzv.run_id}")
        try:
            memdir.create(path)
        except (OSError, memdir.PrivateDirError) as e:
            # Another user may have taken the predictable name first (/dev/shm is everyone's):
            # a name nobody can know in advance instead, or no directory without /dev/shm.
            last = [
                e.get("memory_tier")
                for e in load_events(self.run_dir)
                if e["event"] == "start" and isinstance(e.get("memory_tier"), str)
            ]
            try:
                path = memdir.fallback(last[-1] if last else None)
            except OSError as e2:
                log.warning("no memory-tier directory for the workers (%s; %s)", e, e2)
                return None
            log.warning(
                "%s; the memory tier of this run uses %s instead (the next start of this "
                "run directory takes it again)",
                e,
                path,
            )
        self._memory = path
        os.environ[memdir.ENV] = os.environ[memdir.AGENT_ENV] = path
        return path

    def _drop_memory_tier(self, env_before: str | None) -> None:
        """The job ended (done or stopped): its memory tier goes; the disk tier stays."""
        if self._memory is None:
            return
        if env_before is None:
            os.environ.pop(memdir.ENV, None)
        os.environ.pop(memdir.AGENT_ENV, None)
        try:
            memdir.remove(self._memory)
        except OSError as e:
            log.warning("memory tier %s not removed: %s", self._memory, e)
        self._memory = None

    def _release_store(self, coord: Coordinator, code: int) -> None:
        try:
            coord.set_done(code)
            if coord.hosting:
                late = coord.wait_peers_done(timeout=60.0, silent_after=self.cfg.rdzv.node_timeout)
                if late:
                    log.warning("closing the rendezvous store while %s still run", late)
        except RuntimeError as e:
            log.debug("store already gone at exit: %s", e)

    def _loop(self, coord: Coordinator, number: int) -> int:
        ok, _ = self._preflight(coord, wait=True)
        if not ok:
            return faults.EXIT_PREEMPTED if self._signal is not None else faults.EXIT_PREFLIGHT
        gen = coord.gen()
        while True:
            att = self._launch(coord, number, gen)
            out = self._monitor(att, coord)
            if out.kind == "exit":  # a rank failed, the agent did not: keep it
                self._kept = att.release()
            att.close()
            heartbeat.remove_empty_dumps(self.run_dir, att.number)
            if out.kind == "success":
                log.info("attempt %d finished successfully", number)
                return faults.EXIT_OK
            if out.stop is not None:
                log.error("another node stopped the job: %s", out.stop[1])
                return out.stop[0]
            code = self._handle_failure(coord, att, out)
            if code is not None:
                return code
            if self._signal is not None:
                return faults.EXIT_PREEMPTED
            gen = coord.bump(att.gen) if out.kind != "peer" else coord.gen()
            fresh = time.monotonic() - self._preflight_ok_at < 5.0
            ok = fresh or self._preflight(coord, wait=True)[0]
            if not ok:
                return faults.EXIT_PREEMPTED if self._signal is not None else faults.EXIT_PREFLIGHT
            number += 1

    def _finish(self) -> None:
        summary = recovery.summarize(load_events(self.run_dir))
        lines = b"".join(json.dumps(r.to_json()).encode() + b"\n" for r in summary.recoveries)
        atomic_write_bytes(
            os.path.join(self.run_dir, "recovery.jsonl"), lines, mode=events.FILE_MODE
        )
        print(recovery.format_summary(summary), flush=True)


_EXIT_BARRIER = 300.0
"""Seconds torchrun's agent waits for the other nodes' agents after its workers succeeded
(``LocalElasticAgent``'s ``exit_barrier_timeout``)."""


def run(command: Sequence[str], **kwargs: Any) -> int:
    """Convenience: ``run(["train.py", "--lr", "3e-4"], run_dir="r", nproc_per_node=2)``."""
    return Supervisor(RunConfig(tuple(command), **kwargs)).run()
