"""A pre-warmed torchrun agent with a fork server for its workers (``unbroken run`` default).

A restart used to pay ``import torch`` twice before the first new step: once in the fresh
torchrun agent, once in every fresh worker (3-4 s each on a busy 2-core box, see
benchmarks/RESULTS.md). The supervisor therefore keeps the *next* attempt's agent waiting
(:class:`Standby`): it imports torch and torchrun while the current attempt trains, forks
the fork server (:mod:`.forkserver`, which imports the workers' ``preload`` modules), and
waits on stdin. On a restart the supervisor writes one JSON line ``{"argv": [torchrun
args], "env": {...}}`` (:meth:`Standby.go`) and the standby runs torchrun's ``main``
in-process: it is the attempt's agent, and its workers are forked by the server.

With ``unbroken run --no-prewarm`` the standby is *bare* (``--bare``): the agent is started
ahead all the same, but without a fork server. Any failure to pre-warm falls back to the
plain path: no standby -> a fresh ``python -m torch.distributed.run``; no fork server -> the
launcher starts a fresh ``python -u SCRIPT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

from unbroken.elastic.launch.attempt import Agent, attempt_env, kill_attempt
from unbroken.elastic.launch.forkserver import attempt_event, pdeathsig, start_server
from unbroken.elastic.launch.worker import ENV_ZYGOTE

__all__ = ["Standby"]


BARE = "--bare"
"""The standby's first argument when it starts no fork server."""
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
    ) -> None:
        """``fork_server=False``: a bare standby (``unbroken run --no-prewarm``): the agent
        is started ahead with torch and torchrun imported, its workers start as fresh
        interpreters (no fork server, nothing preloaded for them)."""
        self.number = number
        self.run_dir = run_dir
        self.token = uuid.uuid4().hex
        self.t_start = time.time()
        self.argv = [sys.executable, "-m", __name__, *([BARE] if not fork_server else preload)]
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

    def go(self, torchrun_argv: list[str], env: dict[str, str]) -> bool:
        """Turn the standby into the running agent; False if it cannot take the order."""
        req = {"argv": torchrun_argv, "env": env, "log": os.path.join(self.agent.dir, "zygote.log")}
        pipe = self.agent.proc.stdin
        if pipe is None or not self.alive():
            return False
        try:
            pipe.write(json.dumps(req).encode() + b"\n")
            pipe.close()
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Dismiss an unused standby (nothing of it survives; it is reaped)."""
        with contextlib.suppress(OSError):
            if self.agent.proc.stdin is not None:
                self.agent.proc.stdin.close()
        kill_attempt(self.agent.proc, self.token)
        self.agent.close()


def main(argv: list[str]) -> None:
    """The standby process: import, fork the server, wait for the go order, be the agent."""
    pdeathsig(signal.SIGKILL)  # a standby dies with its supervisor
    preload = [m for m in argv if m.strip()]  # not the TITLE_ROOM
    bare = preload[:1] == [BARE]
    t0 = time.perf_counter()
    import torch

    rng = torch.default_generator.get_state()  # what a fresh interpreter starts with
    from torch.distributed.run import main as torchrun

    from unbroken.common import events

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
    line = sys.stdin.readline()
    if not line:
        os._exit(0)  # the supervisor no longer needs this attempt (the server follows)
    pdeathsig(0)  # from here on this is a torchrun agent and lives like one
    req = json.loads(line)
    os.environ.update(req["env"])
    if server is not None:
        os.environ[ENV_ZYGOTE] = f"{name} {server} {key}"
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = ["torchrun", *req["argv"]]
    torchrun(req["argv"])


if __name__ == "__main__":
    main(sys.argv[1:])
