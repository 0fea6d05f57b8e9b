"""A pre-warmed torchrun agent with a fork server for its workers (``unbroken run`` default).

A restart used to pay ``import torch`` twice before the first new step: once in the fresh
torchrun agent, once in every fresh worker (3-4 s each on a busy 2-core box, see
benchmarks/RESULTS.md). The supervisor therefore keeps the *next* attempt's agent waiting:

1. ``python -m unbroken.elastic._standby`` starts while the current attempt trains, with the
   next attempt's environment (run dir, attempt number, kill token). It imports torch and
   torchrun (what the agent needs), then forks the **fork server**, which imports the
   ``preload`` modules (``_attempt.DEFAULT_PRELOAD``, what the workers need), appends a
   ``standby`` event (``seconds``: the import time a restart no longer pays) and serves;
   the standby itself waits on stdin. A cold restart (no standby ready yet) thus rendezvouses
   while the server is still importing.
2. On a restart the supervisor writes one JSON line ``{"argv": [torchrun args], "env":
   {...}}``; the standby runs torchrun's ``main`` in-process: it is the attempt's agent.
3. torchrun starts ``_launch.py`` per rank (``--no-python``); each launcher asks the fork
   server, over an abstract Unix socket named in ``UNBROKEN_ZYGOTE`` (only processes of the
   same user may connect: ``SO_PEERCRED``), for a worker. The server (single-threaded: it
   never started a thread, a CUDA context or a process group) forks one, which takes the
   launcher's argv, environment, working directory and stdio, starts its own session and
   runs the script as ``__main__`` (``runpy``). The server reports the worker's pid and,
   when it ends, its wait status to the launcher.

The server calls ``gc.freeze()`` before each fork (CPython's advice for fork servers), so the
pages of the preloaded modules stay shared. A forked worker starts as a fresh interpreter
would: torch's default generator holds the state it had right after ``import torch``; ``random`` (by CPython) and numpy's global
generator (here) are reseeded from the OS; ``OMP_NUM_THREADS`` of the worker's environment is
applied. Any failure to pre-warm falls back to the plain path: no standby -> a fresh
``python -m torch.distributed.run``; no fork server (it crashed, or a preloaded module
initialised CUDA, after which a fork could not use the GPU) -> the launcher starts a fresh
``python -u SCRIPT``.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

from unbroken.elastic._launch import ENV_ZYGOTE

__all__: list[str] = []


_PR_SET_PDEATHSIG = 1


def _pdeathsig(sig: int) -> None:
    """Let the kernel send ``sig`` to this process when its parent dies (0: stop that)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _event(name: str, **fields: Any) -> None:
    from unbroken.common import events

    run_dir = os.environ.get(events.ENV_RUN_DIR)
    if not run_dir:
        return
    with contextlib.suppress(OSError, ValueError):
        rec = {
            "t": time.time(),
            "event": name,
            "pid": os.getpid(),
            "attempt": int(os.environ.get(events.ENV_ATTEMPT, "-1")),
        }
        rec.update(fields)
        events.append_event(run_dir, rec)


def _preload(names: list[str], stop: Any = None) -> dict[str, str]:
    """Import ``names`` (until ``stop()`` says a worker is waiting); returns the failures by
    module, and the modules not imported because of the stop under ``"<skipped>"``.

    ``PYTORCH_NVML_BASED_CUDA_CHECK`` keeps a module that asks ``torch.cuda.is_available()``
    at import time from initialising CUDA in this process (forked workers could not use it).
    """
    failed: dict[str, str] = {}
    old = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        for i, name in enumerate(names):
            if stop is not None and stop():
                failed["<skipped>"] = ", ".join(names[i:])
                break
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - a broken preload must not cost the restart
                failed[name] = f"{type(e).__name__}: {e}"
    finally:
        if old is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = old
    return failed


def main(argv: list[str]) -> None:
    _pdeathsig(signal.SIGKILL)  # a standby dies with its supervisor
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
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(64)
    sys.stdout.flush()
    sys.stderr.flush()
    standby = os.getpid()
    if os.fork() == 0:
        work = _Zygote(listener, standby, log, [m for m in argv if m], t0).serve()
        if work is None:
            os._exit(0)
        _run_worker(work, rng)  # the interpreter then exits as the script's would
        return
    listener.close()
    line = sys.stdin.readline()
    if not line:
        os._exit(0)  # the supervisor no longer needs this attempt (the server follows)
    _pdeathsig(0)  # from here on this is a torchrun agent and lives like one
    req = json.loads(line)
    os.environ.update(req["env"])
    os.environ[ENV_ZYGOTE] = name
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = ["torchrun", *req["argv"]]
    torchrun(req["argv"])


class _Zygote:
    """The fork server: single-threaded, it only accepts, forks, reaps and reports."""

    def __init__(
        self, listener: socket.socket, agent: int, log: str | None, preload: list[str], t0: float
    ) -> None:
        self.listener = listener
        self.agent = agent
        self.me = os.getpid()
        self.refused: str | None = None
        self._preload = (preload, t0)
        self.interp_env = {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}
        self.conns: dict[int, socket.socket] = {}  # worker pid -> its launcher's connection
        # Stay up through the signals meant for the agent's process group; the supervisor
        # ends this process by SIGKILL or it leaves once the agent and its workers are gone.
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        try:
            out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            out = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(out, fd)
        os.close(out)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        try:
            self.agent_fd: int | None = os.pidfd_open(agent)
        except (OSError, AttributeError):
            self.agent_fd = None

    def _warm_up(self) -> None:
        names, t0 = self._preload

        def asked() -> bool:
            # A cold restart's launchers are already waiting: fork them now; they import
            # what they need themselves rather than wait for all of the list.
            return bool(select.select([self.listener], [], [], 0)[0])

        failed = _preload(names, asked)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            self.refused = "a preloaded module initialised CUDA, which a fork cannot use"
        _event(
            "standby",
            seconds=round(time.perf_counter() - t0, 3),
            preload=names,
            failed=failed,
            fork_server=self.refused is None,
        )

    def _agent_alive(self) -> bool:
        return os.getppid() == self.agent

    def serve(self) -> dict[str, Any] | None:
        """Loop until the agent and every worker are gone (returns None) — or return a
        request inside a freshly forked worker."""
        self._warm_up()  # launchers that connect meanwhile wait in the listen backlog
        while True:
            if not self._agent_alive() and self.listener.fileno() >= 0:
                self.listener.close()
            if self.listener.fileno() < 0 and not self.conns:
                return None
            fds: list[Any] = [self.wake_r, *self.conns.values()]
            if self.listener.fileno() >= 0:
                fds.append(self.listener)
            if self.agent_fd is not None and self._agent_alive():
                fds.append(self.agent_fd)
            ready, _, _ = select.select(fds, [], [], 1.0)
            for r in ready:
                if r is self.listener:
                    work = self._accept()
                    if work is not None:
                        return work
                elif r == self.wake_r:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        os.read(self.wake_r, 512)
                elif isinstance(r, socket.socket):
                    self._launcher_gone(r)
            self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.conns.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                conn.close()

    def _launcher_gone(self, conn: socket.socket) -> None:
        try:
            if conn.recv(1):
                return
        except OSError:
            pass
        # Its launcher was killed: the worker must not outlive it (torchrun believes it gone).
        for pid, c in list(self.conns.items()):
            if c is conn:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.conns.pop(pid)
                conn.close()

    def _accept(self) -> dict[str, Any] | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        fds: list[int] = []
        try:
            conn.settimeout(10.0)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid():
                raise PermissionError(f"connection from uid {uid}")
            msg, anc, _flags, _addr = conn.recvmsg(4, socket.CMSG_LEN(3 * 4))
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(data[: len(data) - len(data) % a.itemsize])
                    fds.extend(a)
            (size,) = struct.unpack("!I", msg)
            body = b""
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise ConnectionError("launcher hung up mid-request")
                body += chunk
            req = json.loads(body)
            if len(fds) != 3:
                raise ValueError(f"expected 3 stdio descriptors, got {len(fds)}")
        except (OSError, ValueError, struct.error) as e:
            print(f"fork server: bad request: {e}", flush=True)
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        conn.settimeout(None)
        differ = sorted(
            k
            for k in set(req["env"]) | set(self.interp_env)
            if k.startswith("PYTHON") and req["env"].get(k) != self.interp_env.get(k)
        )
        # PYTHON* variables shaped this interpreter at start-up (PYTHONPATH, PYTHONHASHSEED,
        # ...): with other values a fork would not be what `python SCRIPT` gives.
        why = self.refused or (f"{', '.join(differ)} differ" if differ else None)
        if why:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        # Park every object imported so far outside the collector: a worker's collections
        # (and the final one at its exit) then never touch those pages, which would copy
        # them all (measured: a worker's exit took 3.7 s instead of 0.6 s on a busy box).
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            self._become_worker(conn, fds)
            return dict(req)
        for fd in fds:
            os.close(fd)
        self.conns[pid] = conn
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            self._launcher_gone(conn)
        return None

    def _become_worker(self, conn: socket.socket, fds: list[int]) -> None:
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for c in (self.listener, conn, *self.conns.values()):
            c.close()
        for fd in (self.wake_r, self.wake_w, self.agent_fd):
            if fd is not None:
                os.close(fd)
        os.setsid()  # as torchrun does for its workers
        _pdeathsig(signal.SIGKILL)
        if os.getppid() != self.me:
            os._exit(1)  # the server died before the line above
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            if fd > 2:
                os.close(fd)


def _run_worker(req: dict[str, Any], rng: Any) -> None:
    """Become ``python -u SCRIPT ARGS`` (or ``-m MODULE``) in the launcher's context."""
    import runpy

    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.pop(ENV_ZYGOTE, None)
    gc.enable()
    torch = sys.modules.get("torch")
    if torch is not None:
        if rng is not None:
            torch.default_generator.set_state(rng)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # a fresh interpreter draws its own seed; forks would share one
    argv = list(req["argv"])
    sys.argv = argv
    try:
        if req.get("module"):
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - reported exactly as the interpreter would
        # What `python SCRIPT` prints: the traceback from the script's own frames on, not
        # through this fork server and runpy. Then exit 1 through the normal shutdown.
        tb = e.__traceback__
        while tb is not None and (
            tb.tb_frame.f_code.co_filename in _OUR_FILES
            or "runpy" in tb.tb_frame.f_code.co_filename
        ):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # the hook prints __traceback__
        raise SystemExit(1) from None


_OUR_FILES = frozenset({__file__, os.path.realpath(__file__)})


if __name__ == "__main__":
    main(sys.argv[1:])
