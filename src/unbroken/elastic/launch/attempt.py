"""One attempt: a torchrun agent (the elastic agent) and everything it starts.

torchrun runs with ``--max-restarts 0``: the supervisor owns restarts, so that every failure
passes through classification, backoff and pre-flight. A restart takes a fresh agent
process when one is ready (a standby: nothing of the failed agent carries over); when a
rank failed and none is ready yet, the failed attempt's agent is kept (:meth:`Attempt.release`:
its workers are killed, torchrun's ``main`` returns into the standby's order loop) and only
the workers restart, as in torchrun's own in-agent restart (issue 23: no restart waits for
a standby still importing). Membership changes (a node joining) are still handled inside
torchrun, which does not count them as restarts: it stops the workers and starts new ones
in the same attempt; :meth:`Attempt.membership_change` reports that, so the supervisor
records it as what it is (issue 23: no failure).

The agent is either a pre-warmed :class:`~.standby.Standby` (torch already imported, with a
fork server for the workers, see :mod:`.forkserver`) or, as the fallback, a fresh
``python -m unbroken.elastic.launch.agent`` (torchrun with rank 0's ``MASTER_PORT`` held,
:mod:`.agent`). Either way torchrun starts the launcher
(:mod:`.worker`) per rank, which reports how its rank ended (``worker_exit`` events) and
forwards stop signals.

Layout per attempt: ``RUN_DIR/attempts/<n>/torchrun.log`` (agent console, workers teed into it
with ``[rankN]:`` prefixes), ``RUN_DIR/attempts/<n>/torchelastic/`` (torchrun's
``--log-dir``: per-rank ``stdout.log``/``stderr.log`` and ``@record`` ``error.json``),
``zygote.log`` (the fork server's own messages) and ``peer_failed`` (see
:func:`events.peer_failed`).
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, BinaryIO

from unbroken.common import events
from unbroken.common.fs import atomic_write_bytes, open_private
from unbroken.common.procs import (
    PidWatch,
    children_of,
    cmdline,
    environ_of,
    is_alive,
    kill_matching,
    pids_with_env,
    signal_if_tagged,
)
from unbroken.elastic.faults import WorkerExit
from unbroken.elastic.launch.worker import ENV_ZYGOTE, FORKSERVER_TITLE, LAUNCHER_TITLE

if TYPE_CHECKING:
    from unbroken.elastic.launch.standby import Standby

__all__ = [
    "AGENT_MODULE",
    "DEFAULT_PRELOAD",
    "ENV_TOKEN",
    "LAUNCHER",
    "Agent",
    "Attempt",
    "attempt_env",
    "kill_attempt",
    "worker_command",
]

log = logging.getLogger(__name__)

ENV_TOKEN = "UNBROKEN_ATTEMPT_TOKEN"
"""Inherited by every process of an attempt; the supervisor kills by it (see procs)."""
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
AGENT_MODULE = "unbroken.elastic.launch.agent"
"""A fresh agent (no standby): ``python -m torch.distributed.run`` with rank 0's
``MASTER_PORT`` held (:mod:`.agent`)."""
DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "unbroken.elastic",
    "unbroken.ckpt",
    "unbroken.data",
    "unbroken.common.metrics",
)
"""Modules a standby's fork server imports for the workers (``--preload`` adds more).
``torch._dynamo``: the first optimizer a worker builds imports it (213 modules, ~1 s)."""


def worker_command(command: Sequence[str], module: bool, torchrun_args: Sequence[str]) -> list[str]:
    """torchrun's trailing arguments: the launcher (``worker.py``) in front of the script."""
    exec_ = any(a in ("--no-python", "--no_python") for a in torchrun_args)
    mode = ["--exec"] if exec_ else (["-m"] if module else [])
    return ["--no-python", sys.executable, "-S", LAUNCHER, *mode, *command]


def attempt_env(run_dir: str, number: int, token: str, nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env[events.ENV_RUN_DIR] = run_dir
    env[events.ENV_ATTEMPT] = str(number)
    env[ENV_TOKEN] = token
    env[events.ENV_SUPERVISOR] = str(os.getpid())
    env.setdefault("PYTHONUNBUFFERED", "1")
    # With the agent-shared TCPStore (torch's default) a node that joins a later round
    # (a spare, or a node coming back) waits forever for MASTER_ADDR: rank 0 publishes
    # it only in its first round (dynamic_rendezvous.next_rendezvous; cf. pytorch#123678),
    # and a group restarted by the agent often fails "Gloo connectFullMesh ... Connection
    # refused" (10 of 16 restarts in benchmarks/elastic_recovery.py). A store per round,
    # as before torch 2.4, fixes both.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if nproc > 1:
        # What torchrun sets for its workers; set before the standby imports torch, whose
        # OpenMP runtime reads it once.
        env.setdefault("OMP_NUM_THREADS", "1")
    env.pop(events.ENV_CATCHUP, None)
    env.pop(ENV_ZYGOTE, None)
    return env


class Agent:
    """A torchrun agent process with its console copied to ``torchrun.log``."""

    def __init__(
        self,
        number: int,
        run_dir: str,
        argv: list[str],
        env: dict[str, str],
        echo: bool,
        stdin: int,
    ) -> None:
        self.run_dir = run_dir
        self._tail: collections.deque[str] = collections.deque(maxlen=600)
        self.closing: dict[int, float] = {}
        """Worker process -> when torchrun said it was stopping it (``Sending process N
        closing signal``): every stop of its workers, whoever asked for it (the last 256)."""
        self._echo = echo
        self._lock = threading.Lock()
        self.dir, self._log = self._open_log(number)
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pump, daemon=True, name=f"agent-{number}")
        self._reader.start()

    def _open_log(self, number: int) -> tuple[str, BinaryIO]:
        d = events.private_subdir(self.run_dir, "attempts", str(number))
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        return d, os.fdopen(open_private(os.path.join(d, "torchrun.log"), flags), "ab")

    def switch(self, number: int) -> None:
        """From now on the console belongs to attempt ``number`` (a kept agent)."""
        d, log_file = self._open_log(number)
        with self._lock:
            old, self.dir, self._log = self._log, d, log_file
            self._tail.clear()
        old.close()

    def _pump(self) -> None:
        out = self.proc.stdout
        if out is None:
            return
        # A line is copied in pieces of at most _PIECE bytes: one without end (a worker's
        # dump, a bar drawn with backspaces) would otherwise be held whole, and shown only
        # when it ends. Only a piece that starts a line can be torchrun's own.
        decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        at_start = True
        for raw in iter(lambda: out.readline(_PIECE), b""):
            line = decode(raw)
            starts, at_start = at_start, raw.endswith(b"\n")
            with self._lock:
                self._log.write(raw)
                self._log.flush()
                self._tail.append(line)
                said = _CLOSING.match(raw) if starts else None
                if said and int(said.group(1)) == self.proc.pid:
                    kept = list(self.closing.items())[-255:]
                    self.closing = {**dict(kept), int(said.group(2)): time.time()}
            if self._echo:
                with contextlib.suppress(OSError, ValueError):
                    sys.stdout.write(line)
                    sys.stdout.flush()

    def console(self) -> str:
        if self.proc.poll() is not None:  # a live (kept) agent's console has no end yet
            self._reader.join(timeout=2.0)
        with self._lock:
            return "".join(self._tail)

    def close(self) -> None:
        self._reader.join(timeout=2.0)
        with self._lock, contextlib.suppress(OSError):
            self._log.close()


_LAUNCHER_OF = re.compile(re.escape(LAUNCHER_TITLE) + r"\d+, worker (\d+)\]")
"""A launcher's title (``worker.set_title``): the pid of its worker."""

_PIECE = 8192
"""Bytes of the console copied at a time (the tail keeps 600 of them at most)."""

_CLOSING = re.compile(rb"[IWE]\d{4} [\d:.]+ +(\d+) .*\] Sending process (\d+) closing signal SIG")
"""torchrun's warning as it stops a worker (``multiprocessing/api.py``, ``_close``): its
own log line (glog prefix with the agent's pid, checked), never a worker's teed output,
which torchrun prefixes with ``[rankN]:`` (a job's print cannot pose as torchrun)."""


_CONSOLE_LAG = 0.3
"""Seconds a launcher that vanished without a report waits for torchrun's console to say
it stopped it, before it counts as a failure (a SIGKILLed launcher: only ~0.3 s later)."""


def kill_attempt(proc: subprocess.Popen[bytes], token: str) -> int:
    """SIGKILL a process group and every process carrying ``token``; reap the leader."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    n = kill_matching(ENV_TOKEN, token, timeout=10.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)
    return n


class Attempt:
    def __init__(
        self,
        *,
        number: int,
        gen: int,
        run_dir: str,
        torchrun_argv: Sequence[str],
        catchup_step: int | None,
        echo: bool,
        nproc: int = 1,
        standby: Standby | None = None,
    ) -> None:
        self.number = number
        self.gen = gen
        self.run_dir = run_dir
        self.dir = events.private_subdir(run_dir, "attempts", str(number))
        self.log_dir = os.path.join(self.dir, "torchelastic")
        self._events = events.EventTail(run_dir)
        self.exits: list[WorkerExit] = []
        self._launchers: dict[int, int | None] = {}  # launcher pid -> its rank
        self._watch = PidWatch()
        self.killed_by_us = False
        self._stopping = False
        """The supervisor stopped (or killed) this attempt's workers."""
        self._agent_stop: tuple[float, float] | None = None
        """(its first worker's exit, when seen): torchrun stopped its workers by itself."""
        self._seen: dict[int, float] = {}  # launcher pid -> when first seen
        self._gone_since: dict[int, float] = {}  # unreported launcher pid -> when found gone
        self._restarted = 0.0
        """When the last membership change was reported (its stop is old news after that)."""
        self._idle = False
        targv = ["--log-dir", self.log_dir, *torchrun_argv]
        # A kept agent carries the last attempt's values: every order sets both.
        extra = {
            events.ENV_ATTEMPT: str(number),
            events.ENV_CATCHUP: "" if catchup_step is None else str(catchup_step),
        }
        self.prewarmed: float | None = None
        """Seconds the standby had been warming up when it took over (None: fresh agent)."""
        self.kept = False
        """The agent is the last attempt's, kept: only the workers were restarted."""
        self._standby: Standby | None = None
        """The standby this attempt's agent came from (it can take another order)."""
        self._released = False
        self.t_launch = time.time()
        if standby is not None and standby.number == number and standby.go(targv, extra):
            self.token, self._agent = standby.token, standby.agent
            self.argv = [*standby.argv, "<stdin>", *targv]
            self.prewarmed = self.t_launch - standby.t_start
            self.kept, self._standby = standby.kept, standby
        else:
            if standby is not None:
                standby.close()
            self.token = uuid.uuid4().hex
            self.argv = [sys.executable, "-m", AGENT_MODULE, *targv]
            env = attempt_env(run_dir, number, self.token, nproc)
            env.update(extra)
            self._agent = Agent(number, run_dir, self.argv, env, echo, stdin=subprocess.DEVNULL)
        self.proc = self._agent.proc

    def console(self) -> str:
        """The last ~600 lines of torchrun's console (agent summary included)."""
        return self._agent.console()

    def poll(self) -> int | None:
        """The agent's exit code; 1 once a kept-alive agent said its workers failed."""
        rc = self.proc.poll()
        if rc is None and self._idle:
            return 1
        return rc

    def worker_pids(self) -> list[int]:
        """The live launchers, i.e. torchrun's worker processes (one per local rank)."""
        out = []
        for pid in children_of(self.proc.pid):
            if pid not in self._launchers:
                argv = cmdline(pid)
                if LAUNCHER not in argv and not (argv and argv[0].startswith(LAUNCHER_TITLE)):
                    continue  # the fork server, or a launcher not exec'd yet
                rank = environ_of(pid).get("RANK", "")
                self._launchers[pid] = int(rank) if rank.isdigit() else None
                self._seen[pid] = time.time()
            if is_alive(pid):
                out.append(pid)
        return out

    def launcher_workers(self) -> dict[int, int]:
        """Worker pid -> its live launcher, as the launchers' titles name them."""
        out = {}
        for pid in self.worker_pids():
            m = _LAUNCHER_OF.match(next(iter(cmdline(pid)), ""))
            if m:
                out[int(m[1])] = pid
        return out

    def _read_exits(self) -> None:
        if self._agent_stop is None and not self._stopping:
            # torchrun stopping its workers when nobody asked it to (a membership change),
            # also when no launcher gets to report it (SIGKILLed after torchrun's grace).
            since = max(self.t_launch, self._restarted)
            said = sorted(t for t in self._agent.closing.values() if t > since)
            if said:
                self._agent_stop = (said[0], time.time())
        for e in self._events.read():
            if e.get("attempt") != self.number:
                continue
            if e.get("event") == "worker_exit":
                x = WorkerExit.from_event(e)
                self.exits.append(x)
                if x.stopped and not self._stopping and self._agent_stop is None:
                    # Told to stop, not by us: torchrun restarts its workers (membership).
                    self._agent_stop = (x.t, time.time())
            elif e.get("event") == "agent_idle" and e.get("pid") == self.proc.pid:
                self._idle = True  # torchrun returned: its workers failed

    def failure(self) -> WorkerExit | None:
        """The first rank that failed (not stopped, not a clean or preemption exit), or a
        launcher that vanished without reporting (only SIGKILL can do that)."""
        gone = [p for p in self._launchers if not is_alive(p)]  # before reading: no race
        self._read_exits()
        failed = [x for x in self.exits if x.failed]
        if failed:
            return min(failed, key=lambda x: x.t)
        reported = {x.launcher for x in self.exits}
        for pid in gone:
            if pid in reported:
                continue
            if self._stopped_by_agent(pid):
                # torchrun stopped it by itself (a membership change) and it ended without
                # a report: SIGTERMed before its handlers were up, or SIGKILLed after
                # torchrun's grace. Stopped, not failed.
                self.exits.append(self._vanished(pid, stopped=True))
            elif (
                self._gone_since.setdefault(pid, time.time()) > time.time() - _CONSOLE_LAG
                and self.proc.poll() is None
                and not self._idle
            ):
                continue  # torchrun's line about it may still be in the pipe: look again
            else:
                # Only SIGKILL ends a launcher without its report; its worker goes with it
                # (the fork server kills it): the rank died of SIGKILL, a process fault.
                x = self._vanished(pid, stopped=False)
                self.exits.append(x)  # the evidence of the attempt: this rank's end
                return x
        return None

    def _stopped_by_agent(self, launcher: int) -> bool:
        """torchrun named ``launcher`` in a "closing signal" line of this attempt while the
        supervisor had stopped nothing (it stops a failed group's survivors that way too,
        but never the rank that failed: that one has ended already)."""
        t = self._agent.closing.get(launcher)
        return t is not None and t > self.t_launch and not self._stopping

    def _vanished(self, launcher: int, stopped: bool) -> WorkerExit:
        return WorkerExit(
            rank=self._launchers[launcher],
            local_rank=None,
            exitcode=-signal.SIGKILL,
            stopped=stopped,
            pid=None,
            launcher=launcher,
            t=time.time(),
            via="?",
            vanished=True,
        )

    def ranks_ended(self) -> float | None:
        """When the last of this attempt's ranks ended, once every launcher it started has
        reported its exit and none is alive (torchrun not restarting them); else None. The
        agent should exit right after (see ``Supervisor._agent_outlived``)."""
        if not self._launchers or self.restarting() or self.worker_pids():
            return None
        reported = {x.launcher: x.t for x in self.exits}
        if not all(p in reported for p in self._launchers):
            return None
        return max(reported[p] for p in self._launchers)

    def restarting(self) -> bool:
        """torchrun is restarting its workers by itself (between the stop and the new ones)."""
        return self._agent_stop is not None

    def membership_change(self) -> tuple[float, float, float] | None:
        """``(t_stop, t_seen, t_up)`` once torchrun, alive, restarted its workers by itself
        and the new ones are up: its first worker's exit, when the supervisor saw it, when
        the new launchers appeared. With ``--max-restarts 0`` torchrun restarts workers in
        the agent only to admit a node waiting in the rendezvous (a membership change, not
        a failure). Reported once per restart; None otherwise."""
        if self._agent_stop is None or self.proc.poll() is not None or self._idle:
            return None
        t_stop, t_seen = self._agent_stop
        new = [self._seen[p] for p in self.worker_pids() if self._seen[p] > t_stop]
        if not new:
            return None
        self._agent_stop, self._restarted = None, time.time()
        return t_stop, t_seen, min(new)

    def owns(self, pid: int) -> bool:
        """``pid`` (e.g. from a beacon file) is a live process of this attempt: its
        environment carries the attempt's token."""
        return is_alive(pid) and environ_of(pid).get(ENV_TOKEN) == self.token

    def wait(self, pids: Iterable[int], timeout: float) -> None:
        """Sleep ``timeout`` s, or less if the agent or one of ``pids`` exits."""
        self._watch.wait([self.proc.pid, *pids], timeout)

    def stop_workers(
        self, reason: str, grace: float, ranks_by_pid: dict[int, int]
    ) -> tuple[list[int], list[int], float]:
        """After a rank failed: mark ``peer_failed``, SIGTERM the other workers, SIGKILL
        whatever is left after ``grace`` seconds (with the agent). Returns the ranks that
        exited in time, those killed, and the seconds it took."""
        t0 = time.monotonic()
        self._stopping = True
        with contextlib.suppress(OSError):
            atomic_write_bytes(
                os.path.join(self.dir, events.PEER_FAILED_FILE),
                reason.encode() + b"\n",
                fsync=False,
                mode=events.FILE_MODE,
            )
        ranks = dict(ranks_by_pid)
        ranks.update({p: r for p, r in self._launchers.items() if r is not None})
        ended = {p for x in self.exits for p in (x.pid, x.launcher)}  # e.g. the failed rank
        # Only processes that carry this attempt's token: a pid from a beacon is a claim.
        targets = [
            p
            for p in ranks
            if p not in ended and signal_if_tagged(p, signal.SIGTERM, ENV_TOKEN, self.token)
        ]
        deadline = t0 + grace
        while True:
            alive = [p for p in targets if is_alive(p)]
            left = deadline - time.monotonic()
            if not alive or left <= 0:
                break
            self._watch.wait(alive, min(left, 0.5))
        killed = sorted({ranks[p] for p in alive})
        exited = sorted({ranks[p] for p in targets} - set(killed))
        if self._standby is not None and self.proc.poll() is None:
            self.kill_workers()  # the agent may be kept for the next attempt (release)
        else:
            self.kill()
        return exited, killed, time.monotonic() - t0

    def terminate(self, grace: float) -> int | None:
        """SIGTERM the agent (it forwards to the workers, which may save), wait ``grace``."""
        self._stopping = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return None

    def _helpers(self) -> list[int]:
        """The agent's children that are not launchers: its fork server."""
        agent = cmdline(self.proc.pid)
        out = []
        for pid in children_of(self.proc.pid):
            argv = cmdline(pid)
            if argv[:1] and argv[0].startswith(FORKSERVER_TITLE) or (argv and argv == agent):
                out.append(pid)
        return out

    def kill_workers(self) -> None:
        """SIGKILL every process of this attempt but the agent and its fork server."""
        self.killed_by_us = self._stopping = True
        kill_matching(
            ENV_TOKEN, self.token, timeout=10.0, exclude={self.proc.pid, *self._helpers()}
        )

    def release(self) -> Standby | None:
        """The agent, to be kept for the next attempt (issue 23: only the workers restart):
        when it came from a standby, lives, and still has its fork server if it had one.
        Then :meth:`close` leaves it running."""
        sb = self._standby
        if sb is None or self.proc.poll() is not None or (sb.fork_server and not self._helpers()):
            return None
        if not self.killed_by_us:
            self.kill_workers()
        self._released = True
        return sb

    def kill(self) -> None:
        """SIGKILL the agent and every process that inherited this attempt's token."""
        self.killed_by_us = self._stopping = True
        n = kill_attempt(self.proc, self.token)
        if n:
            log.debug("attempt %d: killed %d processes", self.number, n)

    def close(self) -> None:
        """Make sure nothing of this attempt runs any more, then release the log file (a
        released agent and its fork server stay: the next attempt has them)."""
        # A released agent's workers were killed when it was released.
        if not self._released and (
            self.proc.poll() is None or pids_with_env(ENV_TOKEN, self.token)
        ):
            self.kill()
        self._read_exits()
        self._watch.close()
        if not self._released:
            self._agent.close()
