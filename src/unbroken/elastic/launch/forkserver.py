"""The fork server: one per pre-warmed agent (see :mod:`.standby`), it forks the workers.

torchrun starts the launcher (:mod:`.worker`) per rank (``--no-python``); each launcher asks
the fork server, over the abstract Unix socket named in ``UNBROKEN_ZYGOTE``, for a worker.
The server (single-threaded: it never started a thread, a CUDA context or a process group)
forks one, which takes the launcher's argv, environment, working directory and stdio, starts
its own session and runs the script as ``__main__`` (``runpy``); the server reports the
worker's pid and, when it ends, its wait status. Before serving it imports the ``preload``
modules and appends a ``standby`` event.

Who may talk to it (T-SHARED-NODE): ``UNBROKEN_ZYGOTE`` is ``NAME PID KEY``; the server
serves only a peer of this uid (``SO_PEERCRED``) whose request carries KEY, and every
request is parsed bounded (8 MiB, 5 s) inside one ``try``: a bad one is logged to
``zygote.log`` (a peer without the key at most once a minute: anyone can connect),
refused with one generic line, and the server serves on. A forked worker
starts as a fresh interpreter would (RNGs, ``OMP_NUM_THREADS``); any failure to pre-warm
falls back to a fresh ``python -u SCRIPT``.

Why a key and not a socket file, and what a forked worker inherits: ARCHITECTURE.md,
"Design notes" > elastic > the standby agent and the fork server.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import gc
import hmac
import importlib
import json
import math
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

from unbroken.elastic.launch.worker import ENV_ZYGOTE, FORKSERVER_TITLE, set_title

__all__ = ["attempt_event", "fork_holding_signals", "pdeathsig", "release_signals", "start_server"]


_PR_SET_PDEATHSIG = 1


def pdeathsig(sig: int) -> None:
    """Let the kernel send ``sig`` to this process when its parent dies (0: stop that)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def die_with_supervisor(sig: int, *, unsupervised_too: bool = False) -> None:
    """:func:`pdeathsig` against the ``unbroken run`` that started this agent (its pid in the
    environment), and ``sig`` at once if it is already gone (the kernel signals only a
    death after the call). Without that pid (started by hand): against whatever parent it
    has where ``unsupervised_too``, else none (an earlier one is cleared)."""
    from unbroken.common import events

    try:
        parent = int(os.environ.get(events.ENV_SUPERVISOR, ""))
    except ValueError:
        pdeathsig(sig if unsupervised_too else 0)
        return
    pdeathsig(sig)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def attempt_event(name: str, **fields: Any) -> None:
    """Append ``name`` to the run's event log with this process's pid and attempt."""
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


_HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The stop signals the server ignores and a worker must not: held across the fork."""


def fork_holding_signals() -> int:
    """``os.fork()`` with the stop signals blocked around it. The launcher learns the
    worker's pid (and may forward a SIGTERM) before the child has reset what the server
    ignores; Linux keeps a *blocked* signal pending even while it is ignored, so the child
    holds it until :func:`release_signals` instead of losing it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    pid = os.fork()
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # the server: discarded, ignored
    return pid


def release_signals() -> None:
    """In a forked worker: the stop signals as a fresh interpreter has them, then unblocked
    (one sent since the fork is delivered now: SIGTERM kills, SIGINT raises)."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)


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


def start_server(
    name: str,
    key: str,
    log: str | None,
    preload: list[str],
    t0: float,
    rng: Any,
    event: str = "standby",
) -> int | None:
    """Fork the fork server for this agent (the calling process); returns its pid once it
    listens on the abstract name ``name``, None if it could not start (the launchers then
    start fresh interpreters). In the forked server this never returns: it serves, and
    inside each worker it forks it runs the worker's script and exits as the script does.
    ``event``: what the server appends once its preloads are imported (``standby``: the
    standby is ready; ``fork_server``: one forked on demand at a restart)."""
    agent = os.getpid()
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        set_title(f"{FORKSERVER_TITLE}{agent}]", "ub-forkserver")
        try:
            zygote = _Zygote(name, key, agent, log, preload, t0, ready_w, event)
        except BaseException as e:  # noqa: BLE001 - said in the log; the agent falls back
            print(f"fork server: cannot start: {e}", flush=True)
            os._exit(1)
        work = zygote.serve()
        if work is None:
            os._exit(0)
        _run_worker(work, rng)
        raise SystemExit(0)  # the script ended: exit as `python SCRIPT` does
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as f:
        up = f.read(1) == b"1"
    if not up:
        os.waitpid(pid, 0)
    return pid if up else None


_MAX_REQUEST = 8 << 20
"""Bytes of one request (argv, environment, cwd); Linux caps argv + environment far lower."""
_REQUEST_SECONDS = 5.0
"""A launcher sends its request at once; the single-threaded server waits no longer."""
_REFUSED = json.dumps({"refused": "request refused (the fork server's zygote.log says why)"})


_QUIET_SECONDS = 60.0
"""Refusals of peers that did not prove the key are logged once per this many seconds (with
how many more there were): anyone on the node can connect, tens of thousands of times a
second, and ``zygote.log`` must not fill the run directory's disk for them."""


class _Refused(Exception):
    """A request the server does not serve (logged; the client learns nothing of why).
    ``proven``: the peer held the key (one of our launchers: always logged)."""

    def __init__(self, why: str, proven: bool = False) -> None:
        super().__init__(why)
        self.proven = proven


def _parse_request(body: bytes) -> dict[str, Any]:
    """The request's fields, each of its type, or ``_Refused``."""
    try:
        req = json.loads(body)
    except ValueError as e:  # UnicodeDecodeError included
        raise _Refused(f"not JSON ({type(e).__name__})") from None
    if not isinstance(req, dict):
        raise _Refused(f"a JSON {type(req).__name__}, not an object")
    argv, env, cwd = req.get("argv"), req.get("env"), req.get("cwd")
    module, key = req.get("module", False), req.get("key")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise _Refused("argv is not a non-empty list of strings")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise _Refused("env is not an object of strings")
    if not isinstance(cwd, str) or not isinstance(module, bool) or not isinstance(key, str):
        raise _Refused("cwd, module or key has the wrong type")
    return {"argv": argv, "env": env, "cwd": cwd, "module": module, "key": key}


def _received_fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    out: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % a.itemsize])
            out.extend(a)
    return out


_MAX_PENDING = 256
"""Requests read side by side at most; a connection beyond them is refused unread (its
launcher then starts a fresh interpreter), so idle peers cannot exhaust descriptors."""


class _Pending:
    """A request being read: the server reads every pending one as its bytes arrive (a
    peer that sends nothing holds up nobody) until it is whole or its time is up."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        self.deadline = time.monotonic() + _REQUEST_SECONDS
        self.fds: list[int] = []
        self.size: int | None = None
        self.body = bytearray()

    def read(self) -> bytes | None:
        """Read what has arrived; the whole body once it is all there, else None."""
        if self.size is None:  # the length and the stdio descriptors come in one sendmsg
            msg, anc, _flags, _addr = self.conn.recvmsg(4, socket.CMSG_SPACE(3 * 4))
            self.fds.extend(_received_fds(anc))
            if len(msg) != 4:
                raise _Refused(f"pid {self.pid}: request cut short")
            (self.size,) = struct.unpack("!I", msg)
            if self.size > _MAX_REQUEST:
                raise _Refused(
                    f"pid {self.pid}: a request of {self.size} bytes (at most {_MAX_REQUEST})"
                )
        while len(self.body) < self.size:
            try:
                chunk = self.conn.recv(min(self.size - len(self.body), 1 << 20))
            except BlockingIOError:
                return None
            if not chunk:
                raise _Refused(f"pid {self.pid}: the client hung up mid-request")
            self.body += chunk
        return bytes(self.body)


class _Zygote:
    """The fork server: single-threaded, it only accepts, forks, reaps and reports.

    Who may ask: a process of this uid (``SO_PEERCRED``) that knows ``key`` (64 hex digits
    the standby put in the agent's environment, hence in every launcher's; another user
    cannot read it from ``/proc``, nor can another container's processes). The abstract
    name itself is no secret: ``/proc/net/unix`` lists it to the whole network namespace.
    Every request is read, checked and answered inside one ``try``: a bad one is logged
    and refused with one generic line, and the server serves on.
    """

    def __init__(
        self,
        name: str,
        key: str,
        agent: int,
        log: str | None,
        preload: list[str],
        t0: float,
        ready: int,
        event: str = "standby",
    ) -> None:
        self.agent = agent
        self.event = event
        self.me = os.getpid()
        self.key = key.encode()
        self.refused: str | None = None
        self._pending: list[str] = []
        """Preloads skipped because launchers were waiting (imported later, when idle)."""
        self._preload = (preload, t0)
        self.interp_env = {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}
        self.conns: dict[int, socket.socket] = {}  # worker pid -> its launcher's connection
        self.pending: dict[socket.socket, _Pending] = {}  # requests being read
        self._quiet_until = 0.0  # unproven refusals are only counted until then
        self._unlogged = 0
        # Stay up through the signals meant for the agent's process group; the supervisor
        # ends this process by SIGKILL or it leaves once the agent and its workers are gone.
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        self._redirect_output(log)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        try:
            self.agent_fd: int | None = os.pidfd_open(agent)
        except (OSError, AttributeError):
            self.agent_fd = None
        # Bound and listening in this process: SO_PEERCRED of every connection names this
        # pid, which is what the launchers check before they send anything.
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + name)
        self.listener.listen(64)
        os.write(ready, b"1")
        os.close(ready)

    @staticmethod
    def _redirect_output(log: str | None) -> None:
        from unbroken.common.fs import open_private

        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            out = open_private(log, flags) if log else os.open(os.devnull, os.O_WRONLY)
        except OSError:
            out = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(out, fd)
        os.close(out)

    def _warm_up(self) -> None:
        names, t0 = self._preload

        def asked() -> bool:
            # A cold restart's launchers are already waiting: fork them now; they import
            # what they need themselves rather than wait for all of the list.
            return bool(select.select([self.listener], [], [], 0)[0])

        failed = _preload(names, asked)
        skipped = failed.get("<skipped>")
        self._pending = skipped.split(", ") if skipped else []
        self._check_cuda()
        attempt_event(
            self.event,
            seconds=round(time.perf_counter() - t0, 3),
            preload=names,
            failed=failed,
            fork_server=self.refused is None,
        )

    def _check_cuda(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            self.refused = "a preloaded module initialised CUDA, which a fork cannot use"

    def _preload_one(self) -> None:
        """Import the next preload skipped for a waiting launcher, while idle: the agent may
        be kept for the next attempt (issue 23), whose workers then fork with it imported."""
        if self._pending:
            failed = _preload(self._pending[:1])
            self._pending = self._pending[1:]
            if failed:
                print(f"fork server: preload failed: {failed}", flush=True)
            self._check_cuda()

    def _agent_alive(self) -> bool:
        return os.getppid() == self.agent

    def serve(self) -> dict[str, Any] | None:
        """Loop until the agent and every worker are gone (returns None) — or return a
        request inside a freshly forked worker."""
        self._warm_up()  # launchers that connect meanwhile wait in the listen backlog
        while True:
            if not self._agent_alive() and self.listener.fileno() >= 0:
                self.listener.close()
            if self.listener.fileno() < 0 and not self.conns and not self.pending:
                return None
            fds: list[Any] = [self.wake_r, *self.conns.values(), *self.pending]
            if self.listener.fileno() >= 0:
                fds.append(self.listener)
            if self.agent_fd is not None and self._agent_alive():
                fds.append(self.agent_fd)
            due = min((p.deadline for p in self.pending.values()), default=math.inf)
            wait = min(1.0, max(0.0, due - time.monotonic()))
            ready, _, _ = select.select(fds, [], [], wait)
            if not ready and not self.pending:
                self._preload_one()
            for r in ready:
                if r is self.listener:
                    self._accept()
                elif r in self.pending:
                    work = self._read(self.pending[r])
                    if work is not None:
                        return work
                elif r == self.wake_r:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        os.read(self.wake_r, 512)
                elif isinstance(r, socket.socket):
                    self._launcher_gone(r)
            now = time.monotonic()
            for p in [p for p in self.pending.values() if p.deadline <= now]:
                self._refuse(
                    p, _Refused(f"pid {p.pid}: request not sent within {_REQUEST_SECONDS:g} s")
                )
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
                    os.kill(pid, signal.SIGKILL)  # our unreaped child: it is that process
                self.conns.pop(pid)
                conn.close()

    def _accept(self) -> None:
        """Take a connection: refused at once unless its peer is of this uid (nothing is
        read from it), else its request is read as it arrives (:meth:`_read`)."""
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            conn.close()  # gone already
            return
        pid, uid, _gid = struct.unpack("3i", creds)
        p = _Pending(conn, pid)
        if uid != os.getuid():
            self._refuse(p, _Refused(f"connection from pid {pid} of uid {uid}"))
        elif len(self.pending) >= _MAX_PENDING:
            self._refuse(p, _Refused(f"pid {pid}: {_MAX_PENDING} requests already being read"))
        else:
            conn.setblocking(False)
            self.pending[conn] = p

    def _read(self, p: _Pending) -> dict[str, Any] | None:
        """Read what ``p``'s peer sent; once its request is whole and checked, fork (returns
        the request inside the worker). Any error is a refusal: the server serves on."""
        try:
            body = p.read()
            if body is None:
                return None
            req = self._check(p, body)
        except Exception as e:  # noqa: BLE001 - no request, however malformed, ends the server
            self._refuse(p, e)
            return None
        del self.pending[p.conn]
        p.conn.setblocking(True)
        return self._fork(p.conn, p.fds, req)

    def _refuse(self, p: _Pending, e: Exception) -> None:
        """Log why (bounded), close its descriptors, answer the one generic line, hang up."""
        self.pending.pop(p.conn, None)
        why = e if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
        self._log_refusal(str(why), isinstance(e, _Refused) and e.proven)
        for fd in p.fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            p.conn.send(_REFUSED.encode() + b"\n")  # one short line: never blocks the server
        p.conn.close()

    def _log_refusal(self, why: str, proven: bool) -> None:
        """One line per refusal of a launcher; at most one per ``_QUIET_SECONDS`` for peers
        that did not prove the key, saying how many went unlogged before it."""
        now = time.monotonic()
        if not proven and now < self._quiet_until:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused, not logged)" if self._unlogged else ""
        print(f"fork server: refused a request: {why}{more}", flush=True)
        if not proven:
            self._quiet_until, self._unlogged = now + _QUIET_SECONDS, 0

    def _check(self, p: _Pending, body: bytes) -> dict[str, Any]:
        """The whole request checked: JSON of the right shape, the key, three stdio
        descriptors, this interpreter's ``PYTHON*`` settings."""
        req = _parse_request(body)
        if not hmac.compare_digest(req.pop("key").encode(), self.key):
            raise _Refused(f"pid {p.pid} of this uid does not hold the attempt's key")
        if len(p.fds) != 3:
            raise _Refused(f"pid {p.pid}: expected 3 stdio descriptors, got {len(p.fds)}", True)
        differ = sorted(
            k
            for k in set(req["env"]) | set(self.interp_env)
            if k.startswith("PYTHON") and req["env"].get(k) != self.interp_env.get(k)
        )
        # PYTHON* variables shaped this interpreter at start-up (PYTHONPATH, PYTHONHASHSEED,
        # ...): with other values a fork would not be what `python SCRIPT` gives.
        why = self.refused or (f"{', '.join(differ)} differ" if differ else None)
        if why:
            raise _Refused(f"pid {p.pid}: {why}; it starts a fresh interpreter", True)
        return req

    def _fork(
        self, conn: socket.socket, fds: list[int], req: dict[str, Any]
    ) -> dict[str, Any] | None:
        # Park every object imported so far outside the collector: a worker's collections
        # (and the final one at its exit) then never touch those pages, which would copy
        # them all (measured: a worker's exit took 3.7 s instead of 0.6 s on a busy box).
        gc.freeze()
        pid = fork_holding_signals()
        if pid == 0:
            try:
                self._become_worker(conn, fds)
            except BaseException:  # noqa: BLE001 - a half-made worker must not serve on
                os._exit(1)
            return req
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
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for c in (self.listener, conn, *self.conns.values()):
            c.close()
        for p in self.pending.values():  # requests of others still being read
            p.conn.close()
            for held in p.fds:
                os.close(held)
        for fd in (self.wake_r, self.wake_w, self.agent_fd):
            if fd is not None:
                os.close(fd)
        os.setsid()  # as torchrun does for its workers
        pdeathsig(signal.SIGKILL)
        if os.getppid() != self.me:
            os._exit(1)  # the server died before the line above
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            if fd > 2:
                os.close(fd)
        release_signals()  # last: a stop signal held since the fork acts now, by default


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
    # `ps` and `pgrep -f SCRIPT` find the worker by its script, and see that it is one
    name = argv[0] if req.get("module") else os.path.basename(argv[0])
    rank = os.environ.get("RANK", "?")
    shown = ["-m", *argv] if req.get("module") else argv
    set_title(f"[unbroken worker rank {rank}] {' '.join(shown)}", name)
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
        # What `python SCRIPT` does: print the traceback from the script's own frames on
        # (not through this fork server and runpy), leave the exception where exit hooks
        # look for it (the Checkpointer keeps the memory tier for a restart when it finds
        # one), then exit 1 through the normal shutdown.
        tb = e.__traceback__
        while tb is not None and (
            tb.tb_frame.f_code.co_filename in _OUR_FILES
            or "runpy" in tb.tb_frame.f_code.co_filename
        ):
            tb = tb.tb_next
        e = e.with_traceback(tb)
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = e
        sys.excepthook(type(e), e, tb)  # the hook prints __traceback__
        raise SystemExit(1) from None


_OUR_FILES = frozenset({__file__, os.path.realpath(__file__)})
