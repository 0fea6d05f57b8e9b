"""The worker launcher: what torchrun starts for each rank under ``unbroken run``.

torchrun runs ``python -S worker.py [-m] SCRIPT ARGS`` (``--no-python``) instead of
``python -u SCRIPT ARGS``. This file is run by path and imports only the standard library,
so it is up in milliseconds. It

1. asks the attempt's fork server (``UNBROKEN_ZYGOTE``, :mod:`.forkserver`) for a worker
   running SCRIPT with this process's argv, environment, working directory and stdio, or,
   when there is no server or the listener is not the server (``SO_PEERCRED``; then
   nothing is sent), starts ``python -u SCRIPT ARGS`` itself;
2. forwards the stop signals it receives (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1) to
   the worker, once proven to be its worker (the server's child, held by a pidfd);
3. appends one ``worker_exit`` event to ``RUN_DIR/events.jsonl`` when the worker ends
   (rank, worker pid, exit code or signal, whether it had been told to stop, ``via``),
   which tells the supervisor at once whether a rank *failed* or was stopped;
4. exits the way the worker did (same code, or the same signal), so torchrun's view and its
   failure summary are unchanged;
5. hands torchrun the worker's ``@record`` error file only when it is whole: the worker
   writes it to a side path (``TORCHELASTIC_ERROR_FILE`` + ``.worker``), and this launcher
   moves it into place once the worker has ended, or drops it when it is not a JSON object.
   torch writes that file in place, unguarded, and its agent parses it when the rank exits:
   a worker stopped while writing it (a SIGTERM from the agent as a peer died, a SIGKILL)
   left an empty file, and the agent died of the JSONDecodeError instead of restarting the
   workers (seen as a kept agent lost, issue 23's cold path).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import re
import resource
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time

ENV_ZYGOTE = "UNBROKEN_ZYGOTE"
"""``NAME PID KEY``: the attempt's fork server (set by the standby for its workers): its
abstract socket name, its pid (the launcher talks only to a listener of that pid and this
uid) and the key it asks of every request (64 hex digits, see ``forkserver``)."""
_FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
_STOPS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
_MAX_ANSWER = 4096
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
_SIDE = ".worker"
_MAX_ERROR_FILE = 4 << 20  # a traceback and a message; torch writes far less

_child: int | None = None
"""The worker's pid as reported (signals go only to :data:`_worker`, proven ours)."""
_worker: _Worker | None = None
_pending: list[int] = []
_stopped = False


def zygote_address(value: str) -> tuple[str, int, str] | None:
    """``(name, pid, key)`` from an ``UNBROKEN_ZYGOTE`` value; None when malformed."""
    parts = value.split(" ")
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or len(parts[2]) != 64:
        return None
    return parts[0], int(parts[1]), parts[2]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) from ``/proc/<pid>/stat``; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


class _Worker:
    """A process proven to be this launcher's worker: a child of the expected parent when we
    first looked, and the same process at every signal (a pidfd, or the start time where
    the kernel has no pidfds). A pid that anyone else named is never signalled."""

    def __init__(self, pid: int, parent: int) -> None:
        """Raises ``ProcessLookupError`` when ``pid`` has already ended (nothing to signal)
        and ``LookupError`` when it is not a child of ``parent``."""
        self.pid = pid
        self.fd: int | None = None
        try:
            self.fd = os.pidfd_open(pid)
        except (AttributeError, OSError) as e:
            if isinstance(e, ProcessLookupError):
                raise
        st = _stat(pid)  # read after the pidfd: the pid cannot be reused while fd is open...
        if st is None or not self.alive():  # ...unless it already ended
            self.close()
            raise ProcessLookupError(pid)
        if st[0] != parent:
            self.close()
            raise LookupError(f"pid {pid} is not a child of pid {parent}")
        self.start = st[1]

    def alive(self) -> bool:
        if self.fd is None:
            return _stat(self.pid) is not None
        return not select.select([self.fd], [], [], 0)[0]  # readable once it has ended

    def signal(self, sig: int) -> None:
        with contextlib.suppress(OSError):
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            elif (_stat(self.pid) or (0, -1))[1] == self.start:
                os.kill(self.pid, sig)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _on_signal(signum: int, _frame: object) -> None:
    global _stopped
    if signum in _STOPS:
        _stopped = True
    if _worker is None:
        _pending.append(signum)  # delivered once the worker exists
        return
    _worker.signal(signum)


def _set_child(pid: int, parent: int) -> None:
    """Adopt ``pid`` as the worker if it is a child of ``parent``; deliver pending signals."""
    global _child, _worker
    _child = pid  # what the worker_exit event reports; signals go only to a proven _worker
    rank = os.environ.get("RANK", "?")
    set_title(
        f"{LAUNCHER_TITLE}{rank}, worker {pid}] {' '.join(sys.argv[1:])}",
        f"ub-launcher-{rank}",
    )
    try:
        _worker = _Worker(pid, parent)
    except ProcessLookupError:
        return  # it ended already (the status follows); there is nothing to signal
    except LookupError as e:
        _say(f"worker {e}; it will not be signalled")
        return
    while _pending:
        _worker.signal(_pending.pop(0))


_PR_SET_NAME = 15
LAUNCHER_TITLE = "[unbroken launcher rank "
"""How a launcher's title begins once it has its worker (see :func:`set_title`)."""
FORKSERVER_TITLE = "[unbroken fork server of agent "


def set_title(title: str, comm: str) -> bool:
    """Show ``title`` as this process's command line (``ps``, ``pgrep -f``) and ``comm``
    (15 bytes at most) as its name (``/proc/PID/comm``, ``top``, ``pgrep``), as
    setproctitle does, with the standard library only: the title is written over the
    original argv strings, so it is cut to their length (a forked worker has the fork
    server's, which is padded for it: see ``standby``). False if it could not be done."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(comm.encode()[:15]), 0, 0, 0)
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat 48, 49)
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    room = end - start
    if room < 3:
        return False
    # The title, a NUL, then non-NUL filler up to the last byte: the kernel then reads the
    # command line up to the first NUL (the setproctitle convention), not the old argv.
    text = title.encode("utf-8", "replace").replace(b"\0", b" ")[: room - 2]
    buf = text + b"\0" + b" " * (room - len(text) - 1)
    ctypes.memmove(start, buf, room)
    return True


def _say(msg: str) -> None:
    print(f"unbroken launcher: {msg}", file=sys.stderr, flush=True)


def _connect(value: str) -> tuple[socket.socket, tuple[str, int, str]] | None:
    """A connection to the attempt's fork server, checked to be it (this uid, its pid)."""
    addr = zygote_address(value)
    if addr is None:
        _say(f"{ENV_ZYGOTE} is malformed; starting a fresh interpreter")
        return None
    name, server, _key = addr
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
    except OSError as e:
        sock.close()
        _say(f"fork server {name}: unreachable: {e}; starting a fresh interpreter")
        return None
    if uid != os.getuid() or pid != server:
        sock.close()  # an impostor holds the name: it gets nothing of ours
        _say(
            f"fork server {name}: the listener is pid {pid} of uid {uid}, not the attempt's "
            f"server (pid {server}, uid {os.getuid()}): nothing sent; starting a fresh interpreter"
        )
        return None
    return sock, addr


def _answer(line: bytes) -> dict[str, object]:
    try:
        got = json.loads(line)
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def _via_zygote(value: str, argv: list[str], module: bool) -> int | None:
    """Run the worker in the fork server; its raw wait status (-1: unknown), or None when
    the server cannot take it (then the caller starts a fresh interpreter)."""
    conn = _connect(value)
    if conn is None:
        return None
    sock, (name, server, key) = conn
    req = json.dumps(
        {"argv": argv, "module": module, "env": dict(os.environ), "cwd": os.getcwd(), "key": key}
    ).encode()
    with sock:
        try:
            sock.sendmsg(
                [struct.pack("!I", len(req))],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))],
            )
            sock.sendall(req)
            f = sock.makefile("rb")
            first = _answer(f.readline(_MAX_ANSWER))
        except OSError as e:
            first = {"refused": f"unreachable: {e}"}
        pid = first.get("pid")
        if type(pid) is not int or pid <= 0:
            why = first.get("refused", "no answer")
            _say(f"fork server {name}: {why}; starting a fresh interpreter")
            return None
        _set_child(pid, server)
        try:
            last = f.readline(_MAX_ANSWER)
        except OSError:
            last = b""
    if not last:
        # The server died; its workers die with it (PR_SET_PDEATHSIG). Make sure of it.
        if _worker is not None:
            _worker.signal(signal.SIGKILL)
        done = "killed" if _worker is not None else "not signalled (not proven ours)"
        _say(f"fork server {name} died; worker {_child} {done}")
        return -1
    status = _answer(last).get("status")
    return status if type(status) is int and status >= 0 else -1


def _spawn(argv: list[str], module: bool, exec_: bool) -> int:
    cmd = argv if exec_ else [sys.executable, "-u", *(["-m"] if module else []), *argv]
    p = subprocess.Popen(cmd)
    _set_child(p.pid, os.getpid())
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
            _append(os.path.join(run_dir, "events.jsonl"), line)
    return code


def _append(path: str, line: bytes) -> None:
    """``common.events.append_event``'s open, in the standard library only (this file runs
    with ``-S``): no symlink followed, 0600, a regular file of this user, one write."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{path}: not a regular file of this user")
        os.write(fd, line)
    finally:
        os.close(fd)


def _error_file_aside() -> str | None:
    """Point the worker's ``@record`` error file at its side path; the path torchrun reads."""
    path = os.environ.get(ENV_ERROR_FILE)
    if path:
        os.environ[ENV_ERROR_FILE] = path + _SIDE
    return path or None


_HEAD_MESSAGE = re.compile(rb'^\{\s*"message"\s*:\s*\{\s*"message"\s*:\s*"((?:[^"\\]|\\.)*)')
"""The start of the message in torch's ``@record`` file (``{"message": {"message": ...``)."""


def _message_head(head: bytes, limit: int = 65536) -> str:
    """The message's first characters (at most ``limit`` bytes of its JSON) from the start
    of an error file too big to read whole; "" when it does not start as torch's does."""
    m = _HEAD_MESSAGE.match(head)
    if m is None:
        return ""
    text = m[1][:limit]
    for cut in range(8):  # the limit may split an escape (\\uXXXX: up to 5 bytes)
        with contextlib.suppress(ValueError):
            return str(json.loads(b'"' + text[: len(text) - cut] + b'"'))
    return ""


def _shortened(data: bytes) -> bytes | None:
    """A whole error file with the start of the message of one over the limit (a message
    of many MB: torch writes it twice, with the call stack), else None."""
    head = _message_head(data[:_MAX_ERROR_FILE])
    if not head:
        return None
    note = f" [... cut by the launcher: its error file was over {_MAX_ERROR_FILE} bytes]"
    info = {"py_callstack": "", "timestamp": str(int(time.time()))}
    return json.dumps({"message": {"message": head + note, "extraInfo": info}}).encode()


def _hand_over_error_file(path: str) -> None:
    """Move the worker's error file to ``path`` if it is a JSON object (one over the limit:
    a whole one with the start of its message), else remove it."""
    side = path + _SIDE
    try:
        fd = os.open(side, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return  # none written (or not a file we would follow)
    data = b""
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            while len(data) <= _MAX_ERROR_FILE and (chunk := os.read(fd, 1 << 20)):
                data += chunk
    except OSError:
        data = b""
    finally:
        os.close(fd)
    try:
        whole = len(data) <= _MAX_ERROR_FILE and isinstance(json.loads(data), dict)
    except (ValueError, RecursionError):
        whole = False
    short = _shortened(data) if len(data) > _MAX_ERROR_FILE else None
    try:
        if short is not None:
            fd = os.open(side, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, short)
            finally:
                os.close(fd)
            whole = True
        if whole:
            os.replace(side, path)
            return
        os.unlink(side)
    except OSError:
        return
    _say(
        f"the worker's error file {side} is not a whole JSON object ({len(data)} bytes: cut "
        "short as the worker was stopped, most likely); removed, torchrun reports the exit alone"
    )


def main(args: list[str]) -> None:
    exec_ = args[:1] == ["--exec"]
    module = args[:1] == ["-m"]
    argv = args[1:] if (exec_ or module) else args
    if not argv:
        print("usage: worker.py [-m | --exec] SCRIPT [ARGS...]", file=sys.stderr)
        os._exit(2)
    for s in _FORWARD:
        signal.signal(s, _on_signal)
    error_file = _error_file_aside()
    zygote = os.environ.get(ENV_ZYGOTE)
    status = None
    via = "spawn"
    if zygote and not exec_:
        status = _via_zygote(zygote, argv, module)
        via = "zygote"
    if status is None:
        via = "spawn"
        status = _spawn(argv, module, exec_)
    if error_file:
        _hand_over_error_file(error_file)
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
