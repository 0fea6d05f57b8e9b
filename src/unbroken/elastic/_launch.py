"""The worker launcher: what torchrun starts for each rank under ``unbroken run``.

torchrun runs ``python -S _launch.py [-m] SCRIPT ARGS`` (``--no-python``) instead of
``python -u SCRIPT ARGS``. This file is run by path and imports only the standard library, so
it is up in milliseconds. It then

1. asks the attempt's fork server (``UNBROKEN_ZYGOTE``, see ``_standby``) for a worker: the
   server, which imported torch before the failure, forks one that runs SCRIPT with this
   process's argv, environment, working directory and stdio (passed over the socket with
   ``SCM_RIGHTS``); or, when there is no server or it cannot be reached, starts
   ``python -u SCRIPT ARGS`` itself (the fallback: a plain interpreter, as torchrun would);
2. forwards the stop signals it receives (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1) to the
   worker;
3. appends one ``worker_exit`` line to ``RUN_DIR/events.jsonl`` when the worker ends::

       {"t", "event": "worker_exit", "attempt", "pid" (this launcher), "rank", "local_rank",
        "worker_pid", "exitcode" (negative: killed by that signal; null: unknown),
        "stopped" (this launcher had been sent a stop signal), "via": "zygote"|"spawn"}

   which tells the supervisor at once whether a rank *failed* or was stopped;
4. exits the way the worker did (same code, or the same signal), so torchrun's view and its
   failure summary are unchanged.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import time

ENV_ZYGOTE = "UNBROKEN_ZYGOTE"
"""Abstract socket name of the attempt's fork server (set by the standby for its workers)."""
_FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
_STOPS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})

_child: int | None = None
_pending: list[int] = []
_stopped = False


def _on_signal(signum: int, _frame: object) -> None:
    global _stopped
    if signum in _STOPS:
        _stopped = True
    if _child is None:
        _pending.append(signum)  # delivered once the worker exists
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(_child, signum)


def _set_child(pid: int) -> None:
    global _child
    _child = pid
    while _pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, _pending.pop(0))


def _via_zygote(name: str, argv: list[str], module: bool) -> int | None:
    """Run the worker in the fork server; its raw wait status (-1: unknown), or None when
    the server cannot take it (then the caller starts a fresh interpreter)."""
    req = json.dumps(
        {"argv": argv, "module": module, "env": dict(os.environ), "cwd": os.getcwd()}
    ).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        try:
            sock.connect("\0" + name)
            sock.sendmsg(
                [struct.pack("!I", len(req))],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))],
            )
            sock.sendall(req)
            f = sock.makefile("rb")
            first = json.loads(f.readline() or b"{}")
        except (OSError, ValueError) as e:
            first = {"refused": f"unreachable: {e}"}
        if "pid" not in first:
            print(
                f"unbroken launcher: fork server {name}: {first.get('refused', 'no answer')}; "
                "starting a fresh interpreter",
                file=sys.stderr,
                flush=True,
            )
            return None
        _set_child(int(first["pid"]))
        try:
            last = f.readline()
        except OSError:
            last = b""
    if not last:
        # The server died; its workers die with it (PR_SET_PDEATHSIG). Make sure of it.
        if _child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(_child, signal.SIGKILL)
        print(
            f"unbroken launcher: fork server {name} died; worker {_child} killed",
            file=sys.stderr,
            flush=True,
        )
        return -1
    return int(json.loads(last)["status"])


def _spawn(argv: list[str], module: bool, exec_: bool) -> int:
    cmd = argv if exec_ else [sys.executable, "-u", *(["-m"] if module else []), *argv]
    p = subprocess.Popen(cmd)
    _set_child(p.pid)
    while True:
        try:
            return os.waitpid(p.pid, 0)[1]
        except ChildProcessError:
            return -1


def _record(status: int, via: str) -> int | None:
    """Append the worker_exit line; returns the torchrun-style exit code (None: unknown)."""
    if status < 0:
        code = None
    elif os.WIFSIGNALED(status):
        code = -os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
    run_dir = os.environ.get("UNBROKEN_RUN_DIR")
    if run_dir:
        env = os.environ

        def num(k: str) -> int | None:
            v = env.get(k, "")
            return int(v) if v.lstrip("-").isdigit() else None

        rec = {
            "t": time.time(),
            "event": "worker_exit",
            "attempt": num("UNBROKEN_ATTEMPT"),
            "pid": os.getpid(),
            "rank": num("RANK"),
            "local_rank": num("LOCAL_RANK"),
            "worker_pid": _child,
            "exitcode": code,
            "stopped": _stopped,
            "via": via,
        }
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        with contextlib.suppress(OSError):
            fd = os.open(
                os.path.join(run_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
            )
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
    return code


def main(args: list[str]) -> None:
    exec_ = args[:1] == ["--exec"]
    module = args[:1] == ["-m"]
    argv = args[1:] if (exec_ or module) else args
    if not argv:
        print("usage: _launch.py [-m | --exec] SCRIPT [ARGS...]", file=sys.stderr)
        os._exit(2)
    for s in _FORWARD:
        signal.signal(s, _on_signal)
    name = os.environ.get(ENV_ZYGOTE)
    status = None
    via = "spawn"
    if name and not exec_:
        status = _via_zygote(name, argv, module)
        via = "zygote"
    if status is None:
        via = "spawn"
        status = _spawn(argv, module, exec_)
    code = _record(status, via)
    sys.stdout.flush()
    sys.stderr.flush()
    if code is None:
        os._exit(1)
    if code < 0:
        # Die of the same signal (no core file from this tiny process) so torchrun reports
        # "exitcode: -9 (SIGKILL)" for the rank exactly as it would have without us.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):  # SIGKILL/SIGSTOP: no handler to reset
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
        os._exit(128 - code)
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
