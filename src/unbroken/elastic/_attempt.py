"""One attempt: a child ``torchrun`` (the elastic agent) and everything it starts.

torchrun runs with ``--max-restarts 0``: the supervisor owns restarts, so that every failure
passes through classification, backoff and pre-flight, and so that a restart is a fresh agent
process (a wedged agent or stale in-process state cannot carry over). Membership changes
(a spare joining) are still handled inside torchrun, which does not count them as restarts.

Layout per attempt: ``RUN_DIR/attempts/<n>/torchrun.log`` (agent console, workers teed into it
with ``[rankN]:`` prefixes) and ``RUN_DIR/attempts/<n>/torchelastic/`` (torchrun's
``--log-dir``: per-rank ``stdout.log``/``stderr.log`` and ``@record`` ``error.json``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence

from unbroken.elastic import recovery
from unbroken.elastic._procs import children_of, is_alive, kill_matching

__all__ = ["ENV_TOKEN", "Attempt"]

log = logging.getLogger(__name__)

ENV_TOKEN = "UNBROKEN_ATTEMPT_TOKEN"
"""Inherited by every process of an attempt; the supervisor kills by it (see _procs)."""


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
    ) -> None:
        self.number = number
        self.gen = gen
        self.dir = os.path.join(run_dir, "attempts", str(number))
        os.makedirs(self.dir, exist_ok=True)
        self.log_dir = os.path.join(self.dir, "torchelastic")
        self.token = uuid.uuid4().hex
        self.t_launch = time.time()
        self.killed_by_us = False
        self._tail: collections.deque[str] = collections.deque(maxlen=600)
        self._echo = echo
        env = dict(os.environ)
        env[recovery.ENV_RUN_DIR] = run_dir
        env[recovery.ENV_ATTEMPT] = str(number)
        env[ENV_TOKEN] = self.token
        env.setdefault("PYTHONUNBUFFERED", "1")
        # With the agent-shared TCPStore (torch's default) a node that joins a later round
        # (a spare, or a node coming back) waits forever for MASTER_ADDR: rank 0 publishes
        # it only in its first round (dynamic_rendezvous.next_rendezvous; cf. pytorch#123678),
        # and a group restarted by the agent often fails "Gloo connectFullMesh ... Connection
        # refused" (10 of 16 restarts in benchmarks/elastic_recovery.py). A store per round,
        # as before torch 2.4, fixes both.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        env.pop(recovery.ENV_CATCHUP, None)
        if catchup_step is not None:
            env[recovery.ENV_CATCHUP] = str(catchup_step)
        self.argv = [sys.executable, "-m", "torch.distributed.run", "--log-dir", self.log_dir,
                     *torchrun_argv]
        self._log = open(os.path.join(self.dir, "torchrun.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pump, daemon=True, name=f"torchrun-{number}")
        self._reader.start()

    def _pump(self) -> None:
        out = self.proc.stdout
        if out is None:
            return
        for raw in iter(out.readline, b""):
            self._log.write(raw)
            self._log.flush()
            line = raw.decode("utf-8", "replace")
            self._tail.append(line)
            if self._echo:
                with contextlib.suppress(OSError, ValueError):
                    sys.stdout.write(line)
                    sys.stdout.flush()

    def console(self) -> str:
        """The last ~600 lines of torchrun's console (agent summary included)."""
        self._reader.join(timeout=2.0)
        return "".join(self._tail)

    def poll(self) -> int | None:
        return self.proc.poll()

    def worker_pids(self) -> list[int]:
        return [p for p in children_of(self.proc.pid) if is_alive(p)]

    def terminate(self, grace: float) -> int | None:
        """SIGTERM the agent (it forwards to the workers, which may save), wait ``grace``."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the agent and every process that inherited this attempt's token."""
        self.killed_by_us = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        n = kill_matching(ENV_TOKEN, self.token, timeout=10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10.0)
        if n:
            log.debug("attempt %d: killed %d processes", self.number, n)

    def close(self) -> None:
        """Make sure nothing of this attempt runs any more, then release the log file."""
        if self.proc.poll() is None or kill_matching(ENV_TOKEN, self.token, timeout=0.0):
            self.kill()
        self._reader.join(timeout=2.0)
        with contextlib.suppress(OSError):
            self._log.close()
