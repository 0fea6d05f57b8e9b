"""A pre-warmed torchrun agent with a fork server for its workers (``unbroken run`` default).

A restart used to pay ``import torch`` twice before the first new step: once in the fresh
torchrun agent, once in every fresh worker (3-4 s each on a busy 2-core box, see
benchmarks/RESULTS.md). The supervisor therefore keeps the *next* attempt's agent waiting
(:class:`Standby`): it imports torch and torchrun while the current attempt trains, forks
the fork server (:mod:`.forkserver`, which imports the workers' ``preload`` modules), and
waits on stdin. On a restart the supervisor writes one JSON line ``{"argv": [torchrun
args], "env": {...}}`` (:meth:`Standby.go`) and the standby runs torchrun's ``main``
in-process: it is the attempt's agent, and its workers are forked by the server. When
torchrun's ``main`` ends because the workers failed, the agent appends ``agent_idle`` and
waits for the next order: the supervisor keeps it for the next attempt when no fresh
standby is ready (:meth:`Standby.reuse`; issue 23: only the workers restart).

With ``unbroken run --no-prewarm`` the standby is *bare* (``--bare``): the agent is started
ahead all the same, but holds no fork server while the job trains. With ``--on-demand``
(``--no-prewarm``'s) it forks its fork server when its first order comes, before torchrun
runs: the server starts with the agent's torch already imported (shared pages), imports the
preloads until the launchers ask for workers, and forks them (issue 23 item 2: the ranks of
a node do not each import torch again at a restart). Any failure to pre-warm falls back to
the plain path: no standby -> a fresh agent (``python -m unbroken.elastic.launch.agent``,
torchrun with rank 0's ``MASTER_PORT`` held, :mod:`.agent`); no fork server ->
the launcher starts a fresh ``python -u SCRIPT`` (always, with ``--no-standby``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence

from unbroken.common import events
from unbroken.elastic.launch.attempt import Agent, attempt_env, kill_attempt
from unbroken.elastic.launch.forkserver import attempt_event, die_with_supervisor, start_server
from unbroken.elastic.launch.worker import ENV_ZYGOTE

__all__ = ["Standby"]


BARE = "--bare"
"""The standby's first argument when it starts no fork server ahead."""
ON_DEMAND = "--on-demand"
"""After ``BARE``: fork the fork server at the first order (the preloads follow)."""
TITLE_ROOM = " " * 1024
"""The standby's last argument: blank room in its argv for the titles of the workers its
fork server forks (a title is written over the argv strings, see ``worker.set_title``)."""


class Standby:
    """The next attempt's agent, started ahead and waiting with torch imported.

    It carries that attempt's environment (run dir, attempt number, kill token) from birth,
    so a crash of the supervisor or a kill by token reaches it like any attempt process.
    """

    def __init__(
        self,
        *,
        number: int,
        run_dir: str,
        nproc: int,
        preload: Sequence[str],
        echo: bool,
        fork_server: bool = True,
        on_demand: bool = False,
    ) -> None:
        """``fork_server=False``: a bare standby: the agent is started ahead with torch and
        torchrun imported, no fork server while it waits. ``on_demand`` (``unbroken run
        --no-prewarm``): it forks one at its first order, which forks the workers; without
        (``--no-standby``) its workers start as fresh interpreters."""
        self.number = number
        self.run_dir = run_dir
        self.token = uuid.uuid4().hex
        self.t_start = time.time()
        self.kept = False
        """The agent of an earlier attempt, kept for this one (see :meth:`reuse`)."""
        self.fork_server = fork_server
        """Its workers are forked by its fork server (False: a bare standby)."""
        head = [] if fork_server else [BARE, ON_DEMAND] if on_demand else [BARE]
        self.argv = [
            sys.executable,
            "-m",
            __name__,
            *head,
            *(preload if fork_server or on_demand else ()),
        ]
        self.agent = Agent(
            number,
            run_dir,
            [*self.argv, TITLE_ROOM],
            attempt_env(run_dir, number, self.token, nproc),
            echo,
            stdin=subprocess.PIPE,
        )

    def alive(self) -> bool:
        return self.agent.proc.poll() is None

    def ready(self) -> bool:
        """Its imports are done (its ``standby`` event is in the run's log)."""
        return any(
            e["event"] == "standby" and e.get("attempt") == self.number
            for e in events.load_events(self.run_dir)
        )

    def go(self, torchrun_argv: list[str], env: dict[str, str]) -> bool:
        """Turn the standby into the running agent; False if it cannot take the order."""
        req = {"argv": torchrun_argv, "env": env}
        pipe = self.agent.proc.stdin
        if pipe is None or not self.alive():
            return False
        try:
            pipe.write(json.dumps(req).encode() + b"\n")
            pipe.flush()  # kept open: the agent may serve the next attempt (reuse)
        except OSError:
            return False
        return True

    def reuse(self, number: int, timeout: float = 5.0) -> bool:
        """Make the agent of a failed attempt (its workers stopped) attempt ``number``'s:
        True once it said it is idle (``agent_idle``: torchrun returned, ready for the next
        order) within ``timeout`` seconds; False for an agent that is gone or wedged."""
        pid, deadline = self.agent.proc.pid, time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            if any(
                e["event"] == "agent_idle"
                and e.get("pid") == pid
                and e.get("attempt") == self.number
                for e in events.load_events(self.run_dir)
            ):
                self.number, self.kept = number, True
                self.agent.switch(number)
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Dismiss an unused standby (nothing of it survives; it is reaped)."""
        with contextlib.suppress(OSError):
            if self.agent.proc.stdin is not None:
                self.agent.proc.stdin.close()
        kill_attempt(self.agent.proc, self.token)
        self.agent.close()


def main(argv: list[str]) -> None:
    """The standby process: import, fork the server, wait for a go order, be the agent;
    when torchrun returns, say so (``agent_idle``) and wait for the next order (a kept
    agent, see :meth:`Standby.go`)."""
    die_with_supervisor(signal.SIGKILL, unsupervised_too=True)  # dies with its supervisor
    preload = [m for m in argv if m.strip()]  # not the TITLE_ROOM
    bare = preload[:1] == [BARE]
    on_demand = bare and preload[1:2] == [ON_DEMAND]
    preload = preload[2:] if on_demand else [] if bare else preload
    t0 = time.perf_counter()
    import torch

    rng = torch.default_generator.get_state()  # what a fresh interpreter starts with
    from torch.distributed.run import main as torchrun

    from unbroken.common import events
    from unbroken.elastic.launch.agent import guard_torchrun

    guard_torchrun()  # MASTER_PORT held, planted rendezvous state refused, shutdown whole

    # The fork server starts now, before the go order, and imports the workers' modules
    # itself: the agent needs only torch and torchrun, so a cold restart (no standby ready)
    # rendezvouses while the server is still importing.

    run_dir = os.environ.get(events.ENV_RUN_DIR, "")
    attempt = int(os.environ.get(events.ENV_ATTEMPT, "0"))
    log = os.path.join(events.attempt_dir(run_dir, attempt), "zygote.log") if run_dir else None
    name = f"unbroken-zygote-{os.getpid()}-{os.urandom(6).hex()}"
    key = os.urandom(32).hex()
    server = None if bare else start_server(name, key, log, preload, t0, rng)
    if bare:  # ready: what the fork server says when it has imported its preloads
        attempt_event("standby", seconds=round(time.perf_counter() - t0, 3), fork_server=False)
    # Orders come on the pipe that is stdin now; the workers get /dev/null as stdin.
    orders = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    while True:
        line = orders.readline()
        if not line:
            os._exit(0)  # the supervisor no longer needs this agent (the server follows)
        # From here on this is a torchrun agent: were the supervisor killed outright, it
        # stops its workers as torchrun does on SIGTERM (they save on the way out) instead
        # of training on unsupervised (a node's agent keeps its peers' rendezvous alive).
        die_with_supervisor(signal.SIGTERM)
        req = json.loads(line)
        os.environ.update(req["env"])
        if on_demand and server is None:  # once, before torchrun started a thread
            on_demand = False
            server = start_server(name, key, log, preload, time.perf_counter(), rng, "fork_server")
        if server is not None:
            os.environ[ENV_ZYGOTE] = f"{name} {server} {key}"
        sys.argv = ["torchrun", *req["argv"]]
        if not _workers_failed(torchrun, req["argv"]):
            return  # done: exit as `python -m torch.distributed.run` does
        die_with_supervisor(signal.SIGKILL, unsupervised_too=True)  # idle: useless alone
        attempt_event("agent_idle", rc=1)


def _workers_failed(torchrun: Callable[[list[str]], None], argv: list[str]) -> bool:
    """Run torchrun's ``main``: True when it ended because its workers failed (its summary
    printed as the interpreter prints it at exit); then this agent may serve the next
    attempt. Anything else (a signal, a rendezvous error) ends the process as before."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun(argv)
    except ChildFailedError:
        traceback.print_exc()
        sys.stderr.flush()
        return True
    return False


if __name__ == "__main__":
    main(sys.argv[1:])
