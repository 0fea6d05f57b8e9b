"""The per-rank launcher (``launch/worker.py``) and the fork server (``launch.forkserver``), with real
processes and real signals but without torch or torchrun: an "agent" process hosts a fork
server exactly as a standby does after its go order, and each test runs the launcher the
way torchrun would (``python -S worker.py SCRIPT ARGS``).

Both paths are covered: the worker forked by the server, and the fallback where the
launcher starts a fresh interpreter because no server can be reached.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from unbroken.common import events
from unbroken.common.procs import is_alive, parent_of, proc_state
from unbroken.elastic.launch.attempt import LAUNCHER

pytestmark = pytest.mark.timeout(60)

# The agent: forks the fork server (which never returns here except inside a forked
# worker), reports "<name> <server pid> <key>" and lives until stdin closes.
AGENT = textwrap.dedent("""
    import os, sys
    from unbroken.elastic.launch.forkserver import start_server
    name, key = "unbroken-test-" + os.urandom(6).hex(), os.urandom(32).hex()
    pid = start_server(name, key, sys.argv[1], sys.argv[2:], 0.0, None)
    print(name, pid, key, flush=True)
    sys.stdin.read()
""")

WORKER = textwrap.dedent("""
    import json, os, sys, time
    what = sys.argv[1]
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
                      "cwd": os.getcwd(), "argv": sys.argv, "foo": os.environ.get("FOO"),
                      "path0": sys.path[0], "zygote_env": os.environ.get("UNBROKEN_ZYGOTE")}),
          flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if what == "exit":
        sys.exit(int(sys.argv[2]))
    if what == "kill":
        os.kill(os.getpid(), 9)
    if what == "raise":
        import atexit
        from unbroken.ckpt.checkpointer import _dying_of_an_exception
        # what the Checkpointer's exit hook asks (C-TIERS: the memory tier is kept for a
        # restart when the process ends on an unhandled exception)
        atexit.register(lambda: print("dying of an exception:", _dying_of_an_exception(),
                                      file=sys.stderr, flush=True))
        def inner():
            raise ValueError("boom in the worker")
        inner()
    if what == "sleep":
        time.sleep(60)
    if what == "errfile":  # the @record error file, as torch writes it (in place), then fail
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            f.write(sys.argv[2])
        sys.exit(1)
""")


@pytest.fixture
def agent(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path / "zygote.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert p.stdout is not None
    name, zpid, key = p.stdout.readline().decode().split()
    try:
        yield _zygote_env(name, int(zpid), key), int(zpid)
    finally:
        assert p.stdin is not None
        p.stdin.close()  # the agent exits; the server follows once its workers are gone
        p.wait(10)
        deadline = time.monotonic() + 10
        while is_alive(int(zpid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not is_alive(int(zpid)), "the fork server outlived its agent"
        p.stdout.close()


@pytest.fixture
def server(agent):
    """The fork server: its name, pid and key."""
    zygote, zpid = agent
    name, _pid, key = zygote.split(" ")
    yield name, zpid, key


class Run:
    def __init__(
        self, tmp_path, zygote: str | None, *args: str, module: bool = False, **extra_env: str
    ):
        (tmp_path / "w.py").write_text(WORKER)
        (tmp_path / "cwd").mkdir(exist_ok=True)
        self.out = tmp_path / "out.txt"
        self.err = tmp_path / "err.txt"
        env = dict(
            os.environ,
            FOO="bar",
            RANK="3",
            LOCAL_RANK="1",
            **{events.ENV_RUN_DIR: str(tmp_path), events.ENV_ATTEMPT: "7"},
        )
        env.pop("UNBROKEN_ZYGOTE", None)
        if zygote is not None:
            env["UNBROKEN_ZYGOTE"] = zygote
        target = ["-m", "w"] if module else [str(tmp_path / "w.py")]
        if module:  # `python -m w` finds it in the working directory
            (tmp_path / "cwd" / "w.py").write_text(WORKER)
        env.update(extra_env)
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", LAUNCHER, *target, *args],
                env=env,
                cwd=tmp_path / "cwd",
                stdout=o,
                stderr=e,
                start_new_session=True,
            )
        self.run_dir = str(tmp_path)

    def wait(self) -> int:
        return self.proc.wait(30)

    def info(self) -> dict:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = self.out.read_text()
            if text.strip():
                return json.loads(text.splitlines()[0])
            time.sleep(0.02)
        raise AssertionError(f"the worker printed nothing; stderr: {self.err.read_text()}")

    def exits(self) -> list[dict]:
        return [e for e in events.load_events(self.run_dir) if e["event"] == "worker_exit"]


def test_forked_worker_runs_the_script_in_the_launchers_context(tmp_path, agent):
    name, zpid = agent
    r = Run(tmp_path, name, "exit", "5")
    assert r.wait() == 5
    info = r.info()
    assert info["ppid"] == zpid and info["sid"] == info["pid"]  # forked, own session
    assert info["cwd"] == str(tmp_path / "cwd") and info["foo"] == "bar"
    assert info["argv"] == [str(tmp_path / "w.py"), "exit", "5"]
    assert info["path0"] == str(tmp_path) and info["zygote_env"] is None
    assert "to stderr" in r.err.read_text()  # the launcher's stdio, passed over the socket
    (e,) = r.exits()
    assert (e["exitcode"], e["stopped"], e["via"], e["rank"], e["local_rank"], e["attempt"]) == (
        5,
        False,
        "zygote",
        3,
        1,
        7,
    )
    assert e["worker_pid"] == info["pid"] and e["pid"] == r.proc.pid
    assert not [c for c in _children(zpid) if proc_state(c) == "Z"]  # reaped


def test_module_mode_and_a_clean_exception_traceback(tmp_path, agent):
    name, _ = agent
    r = Run(tmp_path, name, "raise", module=True)
    assert r.wait() == 1
    err = r.err.read_text()
    assert "ValueError: boom in the worker" in err and "in inner" in err
    # what `python -m w` prints: from the script's frames on, not through the fork server
    assert "forkserver.py" not in err and "runpy" not in err, err
    assert r.info()["path0"] == str(tmp_path / "cwd")
    (e,) = r.exits()
    assert (e["exitcode"], e["via"]) == (1, "zygote")


def test_killed_worker_kills_its_launcher_with_the_same_signal(tmp_path, agent):
    name, _ = agent
    r = Run(tmp_path, name, "kill")
    assert r.wait() == -signal.SIGKILL  # torchrun sees "exitcode: -9 (SIGKILL)"
    (e,) = r.exits()
    assert (e["exitcode"], e["stopped"]) == (-9, False)


def test_stop_signal_is_forwarded_and_recorded_as_stopped(tmp_path, agent):
    name, _ = agent
    r = Run(tmp_path, name, "sleep")
    r.info()
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait() == -signal.SIGTERM
    (e,) = r.exits()
    assert (e["exitcode"], e["stopped"]) == (-15, True)


def test_a_killed_launcher_takes_its_forked_worker_along(tmp_path, agent):
    name, _ = agent
    r = Run(tmp_path, name, "sleep")
    worker = r.info()["pid"]
    r.proc.kill()
    r.wait()
    _gone(worker)
    assert not r.exits()  # SIGKILL leaves no report: the supervisor counts that a failure


def test_a_dead_fork_server_takes_its_workers_along(tmp_path, agent):
    name, zpid = agent
    r = Run(tmp_path, name, "sleep")
    worker = r.info()["pid"]
    os.kill(zpid, signal.SIGKILL)
    assert r.wait() == 1
    _gone(worker)
    (e,) = r.exits()
    assert e["exitcode"] is None and "fork server" in r.err.read_text()


def test_preloads_skipped_for_a_waiting_launcher_are_imported_when_idle(tmp_path):
    """issue 23: a launcher waiting while the server imports is served at once (the
    preloads not yet imported are skipped) and the server imports them later, while idle:
    an agent kept for the next attempt then forks its workers with them imported."""
    mods, gate, marker = tmp_path / "mods", tmp_path / "gate", tmp_path / "late-imported"
    mods.mkdir()
    (mods / "ub_gate_mod.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\n"
    )
    (mods / "ub_late_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "has.py").write_text("import sys\nprint('ub_late_mod' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=str(mods), **{events.ENV_RUN_DIR: str(tmp_path)})
    p = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path / "zygote.log"), "ub_gate_mod", "ub_late_mod"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert p.stdout is not None
        name, zpid, key = p.stdout.readline().decode().split()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(20)
            s.connect("\0" + name)  # waits in the backlog while ub_gate_mod imports
            s.sendall(struct.pack("!I", 4) + b"junk")
            gate.write_text("")
            assert b"refused" in s.makefile("rb").readline()  # served (refused) at once
        (ready,) = [e for e in events.load_events(str(tmp_path)) if e["event"] == "standby"]
        # skipped for the waiting connection (ub_gate_mod too, if it came before that import)
        assert ready["failed"]["<skipped>"].endswith("ub_late_mod"), ready
        deadline = time.monotonic() + 20
        while not marker.exists():  # imported once the server was idle
            assert time.monotonic() < deadline, "the skipped preload was never imported"
            time.sleep(0.05)
        out = subprocess.run(
            [sys.executable, "-S", LAUNCHER, str(tmp_path / "has.py")],
            env=dict(env, UNBROKEN_ZYGOTE=_zygote_env(name, int(zpid), key)),
            capture_output=True,
            timeout=30,
            check=True,
        )
        assert out.stdout.decode().strip() == "True", out
        (e,) = [e for e in events.load_events(str(tmp_path)) if e["event"] == "worker_exit"]
        assert e["via"] == "zygote", e
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(10)


@pytest.mark.parametrize("via", ["zygote", "spawn"])
def test_a_worker_ending_on_an_exception_is_seen_so_at_exit_on_both_paths(tmp_path, agent, via):
    """A forked worker's unhandled exception leaves what the interpreter leaves
    (``sys.last_exc`` / ``sys.last_value``), so exit hooks see a crash, not a clean end: the
    Checkpointer then keeps the memory tier (and a lost peer's replica) for the restart. A
    fork server that only printed the traceback made a crash look clean, and the slots were
    removed when the disk held the same step (the node-loss drill restored from disk)."""
    name, _ = agent
    r = Run(tmp_path, name if via == "zygote" else None, "raise")
    assert r.wait() == 1
    err = r.err.read_text()
    assert "ValueError: boom in the worker" in err and "dying of an exception: True" in err, err
    (e,) = r.exits()
    assert (e["exitcode"], e["via"]) == (1, via)


@pytest.mark.parametrize("zygote", [None, "unbroken-test-nobody-listens 1 " + "0" * 64])
def test_fallback_starts_a_fresh_interpreter(tmp_path, zygote):
    r = Run(tmp_path, zygote, "exit", "3")
    assert r.wait() == 3
    info = r.info()
    assert info["ppid"] == r.proc.pid and info["foo"] == "bar"
    (e,) = r.exits()
    assert (e["exitcode"], e["via"]) == (3, "spawn")
    if zygote:
        assert "unreachable" in r.err.read_text()


def test_server_refuses_a_worker_whose_interpreter_settings_differ(tmp_path, agent):
    name, _ = agent
    r = Run(tmp_path, name, "exit", "0", PYTHONHASHSEED="123")
    assert r.wait() == 0
    (e,) = r.exits()
    # issue 20 item 1: the launcher hears a generic refusal (an answer naming the variables
    # that differ helped craft an accepted request); the server's log says which
    assert e["via"] == "spawn" and "refused" in r.err.read_text()
    assert "PYTHONHASHSEED" not in r.err.read_text()
    assert "PYTHONHASHSEED differ" in (tmp_path / "zygote.log").read_text()


def test_fallback_forwards_stop_signals_too(tmp_path):
    r = Run(tmp_path, None, "sleep")
    worker = r.info()["pid"]
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait() == -signal.SIGTERM
    _gone(worker)
    (e,) = r.exits()
    assert (e["exitcode"], e["stopped"], e["via"]) == (-15, True, "spawn")


def _children(pid: int) -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and parent_of(int(n)) == pid]


def _gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not is_alive(pid), f"worker {pid} outlived its launcher or server"


# --- issue 20: who may talk to the fork server, and whom the launcher trusts ----------------


def _zygote_env(name: str, pid: int, key: str) -> str:
    """The launcher's ``UNBROKEN_ZYGOTE`` value for a server at ``name``."""
    return f"{name} {pid} {key}"


def _raw_request(name: str, body: bytes, fds: tuple[int, ...] = (0, 1, 2)) -> dict | None:
    """Send one request as a launcher would (length, stdio fds, body); the first answer, or
    None when the server hung up without one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect("\0" + name)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            s.sendmsg([struct.pack("!I", len(body))], anc)
            s.sendall(body)
            line = s.makefile("rb").readline()
        except (BrokenPipeError, ConnectionResetError):
            return None  # it hung up on us
    return json.loads(line) if line.strip() else None


def _request(tmp_path, marker, key: str | None) -> bytes:
    """A well-formed request for a worker that creates ``marker`` (and exits)."""
    script = tmp_path / "touch.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').close()\n")
    req: dict = {
        "argv": [str(script), str(marker)],
        "module": False,
        "env": {k: v for k, v in os.environ.items() if k != "UNBROKEN_ZYGOTE"},
        "cwd": str(tmp_path),
    }
    if key is not None:
        req["key"] = key
    return json.dumps(req).encode()


def _served_by_zygote(tmp_path, zygote: str) -> None:
    """The server still forks workers for a genuine launcher."""
    r = Run(tmp_path, zygote, "exit", "0")
    assert r.wait() == 0
    assert [e["via"] for e in r.exits()] == ["zygote"], r.err.read_text()


def test_a_same_uid_process_without_the_key_is_refused(tmp_path, server):
    """issue 20 item 1: the abstract name is visible to the whole network namespace (another
    container of the pod, a root sidecar): a peer of the same uid that does not hold the
    attempt's key gets no worker, and the refusal says nothing about why."""
    name, zpid, key = server
    marker = tmp_path / "forked"
    for bad_key in (None, "0" * 64):
        answer = _raw_request(name, _request(tmp_path, marker, bad_key))
        assert answer is not None and "pid" not in answer, answer
        assert "PYTHON" not in json.dumps(answer), answer
    time.sleep(0.2)  # a forked worker would have created the marker by now
    assert not marker.exists(), "the server forked a worker for a request without the key"
    _served_by_zygote(tmp_path, _zygote_env(name, zpid, key))


def test_another_uid_is_refused_even_with_the_key(tmp_path, server):
    """issue 20 item 1: a process of another user (here uid 65534, set in a forked child)
    is refused before the server reads its request, even when it knows the key."""
    name, zpid, key = server
    marker = tmp_path / "forked-for-nobody"
    body = _request(tmp_path, marker, key)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            answer = _raw_request(name, body)
            os.write(w, json.dumps({"answer": answer}).encode())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = json.loads(f.read() or b"{}")
    os.waitpid(child, 0)
    assert "error" not in got, got
    assert got["answer"] is None or "pid" not in got["answer"], got
    time.sleep(0.2)
    assert not marker.exists(), "the server forked a worker for another uid"
    _served_by_zygote(tmp_path, _zygote_env(name, zpid, key))


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b"{}",
        b"null",
        b"not json",
        b"\xff\xfe",
        b'{"argv": "x", "env": {}, "cwd": "/"}',
        b'{"argv": [], "env": {}, "cwd": "/"}',
        b'{"argv": ["x"], "env": [], "cwd": "/"}',
        b'{"argv": ["x"], "env": {"A": 1}, "cwd": "/"}',
        b'{"argv": [1], "env": {}, "cwd": 5}',
    ],
)
def test_a_malformed_request_is_refused_and_the_server_keeps_serving(tmp_path, server, body):
    """issue 20 item 2: a 2-byte ``[]`` used to raise outside the per-request ``try`` and end
    the server, which freed its name for anyone to take."""
    name, zpid, key = server
    answer = _raw_request(name, body)
    assert answer is None or "pid" not in answer, answer
    assert is_alive(zpid), "a malformed request ended the fork server"
    _served_by_zygote(tmp_path, _zygote_env(name, zpid, key))


def test_requests_cut_short_or_without_descriptors_are_refused(tmp_path, server):
    """issue 20 item 2: a request with too few descriptors, or a length it never sends."""
    name, zpid, key = server
    answer = _raw_request(name, _request(tmp_path, tmp_path / "m", key), fds=())
    assert answer is not None and "pid" not in answer, answer
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # says 1 MB, sends 3 bytes
        s.connect("\0" + name)
        s.sendmsg([struct.pack("!I", 1 << 20)], [])
        s.sendall(b"abc")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # says 4 GB
        s.connect("\0" + name)
        s.sendmsg([struct.pack("!I", 0xFFFFFFFF)], [])
    assert is_alive(zpid)
    _served_by_zygote(tmp_path, _zygote_env(name, zpid, key))


class _Impostor:
    """A process that took the fork server's name: records what it is sent, answers
    ``{"pid": victim}`` and hangs up (what a dead server looks like to the launcher)."""

    def __init__(self, victim: int) -> None:
        self.name = "unbroken-impostor-" + os.urandom(6).hex()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.name)
        self.sock.listen(4)
        self.sock.settimeout(30)
        self.received = b""
        self.connected = threading.Event()
        self.victim = victim
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self.connected.set()
        with conn:
            conn.settimeout(2.0)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
                    if len(self.received) > 4:
                        break
            except OSError:
                pass
            try:
                conn.sendall(json.dumps({"pid": self.victim}).encode() + b"\n")
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


@pytest.fixture
def victim():
    """A process of ours that no launcher may signal: not its worker (a grandchild)."""
    p = subprocess.Popen(["sh", "-c", "sleep 120 & echo $!"], stdout=subprocess.PIPE)
    assert p.stdout is not None
    pid = int(p.stdout.readline())
    p.wait(10)
    yield pid
    with __import__("contextlib").suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_a_launcher_facing_an_impostor_keeps_its_environment(tmp_path, victim):
    """issue 20 item 2: the launcher checks who listens (``SO_PEERCRED``: same uid and the
    server's pid, passed by the standby) before it sends anything: an impostor on the name
    gets neither the environment (secrets) nor the stdio, and its answer kills nobody."""
    imp = _Impostor(victim)
    try:
        r = Run(tmp_path, _zygote_env(imp.name, 1, "k" * 64), "exit", "0", SECRET="hunter2")
        assert r.wait() == 0
    finally:
        imp.close()
    assert b"hunter2" not in imp.received and not imp.received, imp.received[:200]
    assert is_alive(victim), "the launcher killed the pid an impostor named"
    (e,) = r.exits()
    assert e["via"] == "spawn"  # it ran the worker itself


def test_the_launcher_signals_only_a_worker_it_can_prove(tmp_path, victim):
    """issue 20 item 2: even a server that passes the peer check (here its expected pid is
    this test's) cannot make the launcher kill a pid that is not the server's child."""
    imp = _Impostor(victim)
    try:
        r = Run(tmp_path, _zygote_env(imp.name, os.getpid(), "k" * 64), "sleep")
        r.wait()
    finally:
        imp.close()
    assert is_alive(victim), "the launcher SIGKILLed a pid it could not prove was its worker"


def test_a_stop_signal_sent_before_a_forked_worker_resets_its_handlers_is_not_lost(tmp_path):
    """A forked worker's pid reaches its launcher before the worker has reset the stop
    signals the fork server ignores; a SIGTERM forwarded in that window (torchrun stopping
    workers that are still starting, seen on a loaded box: the worker then trained 30 s on
    until SIGKILL, and its save-on-SIGTERM never ran) must kill it, as it kills a fresh
    ``python SCRIPT`` that has not installed a handler yet. Here the child sends itself the
    signal at the earliest point, before the reset, as a launcher could."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from unbroken.elastic.launch.forkserver import fork_holding_signals, release_signals
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what the fork server does
        pid = fork_holding_signals()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # lands before the reset
            release_signals()
            time.sleep(5)
            os._exit(0)  # the signal was lost
        _, status = os.waitpid(pid, 0)
        print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status))
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGTERM)  # the server itself still ignores it
        print("server alive")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()
    assert out == [str(int(signal.SIGTERM)), "server", "alive"], out


def test_only_torchruns_own_closing_line_names_a_stopped_worker(tmp_path):
    """issue 23 item 2: a launcher torchrun stopped by itself (a membership restart) is
    told from a failure by torchrun's "Sending process N closing signal" line. Only the
    agent's own log line counts: a worker's teed output (``[rankN]:`` prefix) or a line
    with another process's glog pid cannot pose as torchrun and hide a failure."""
    from unbroken.elastic.launch.attempt import Agent

    line = "W1202 11:40:26.084000 {pid} x/api.py:1028] Sending process {n} closing signal SIGTERM"
    code = textwrap.dedent(
        f"""
        import os
        me = os.getpid()
        print({line!r}.format(pid=me, n=111))
        print("[rank0]:" + {line!r}.format(pid=me, n=222))
        print({line!r}.format(pid=me + 1, n=333))
        print("Sending process 444 closing signal SIGTERM")
        """
    )
    agent = Agent(
        0, str(tmp_path), [sys.executable, "-c", code], dict(os.environ), False, subprocess.DEVNULL
    )
    agent.proc.wait(timeout=60)
    agent.close()
    assert set(agent.closing) == {111}, agent.console()


def test_the_error_file_hand_over_follows_no_link_blocks_on_no_fifo_and_bounds_its_read(tmp_path):
    """The side path is in the attempt's private directory, but what is found there is
    still untrusted: a symlink is not followed (its target stays as it was and nothing
    reaches torchrun's path), a FIFO does not block the launcher, an oversized file is not
    read whole; the last two are removed."""
    from unbroken.elastic.launch import worker

    path = str(tmp_path / "error.json")
    side = path + ".worker"
    target = tmp_path / "elsewhere.json"
    target.write_text('{"message": "not the worker\'s"}')
    os.symlink(target, side)
    worker._hand_over_error_file(path)
    assert not os.path.exists(path) and os.path.islink(side)
    assert target.read_text() == '{"message": "not the worker\'s"}'
    os.unlink(side)

    os.mkfifo(side)  # no writer: a blocking open or read would never return
    worker._hand_over_error_file(path)
    assert not os.path.exists(path) and not os.path.lexists(side)

    with open(side, "w") as f:  # a JSON object larger than the bound
        f.write('{"x": "' + "a" * (worker._MAX_ERROR_FILE + 10) + '"}')
    worker._hand_over_error_file(path)
    assert not os.path.exists(path) and not os.path.lexists(side)


@pytest.mark.parametrize("served", [True, False], ids=["forked", "fresh interpreter"])
def test_only_a_whole_error_file_reaches_torchrun(tmp_path, agent, served):
    """torchrun parses a failed rank's ``@record`` error file and dies of a JSONDecodeError
    when it is empty or cut short (torch writes it in place; a worker stopped mid-write
    leaves it so): the kept agent of ``--no-standby`` was lost that way. The launcher hands
    torchrun the worker's file once the worker has ended, and only when it is whole."""
    whole = json.dumps({"message": {"message": "boom", "extraInfo": {"py_callstack": "tb"}}})
    for i, (written, handed) in enumerate([(whole, True), ("", False), (whole[:20], False)]):
        d = tmp_path / str(i)
        d.mkdir()
        target = d / "error.json"
        zygote = agent[0] if served else None
        r = Run(d, zygote, "errfile", written, TORCHELASTIC_ERROR_FILE=str(target))
        assert r.wait() == 1
        assert r.exits()[0]["via"] == ("zygote" if served else "spawn")
        assert sorted(os.listdir(d / "cwd")) == [] and not (d / "error.json.worker").exists()
        if handed:
            assert target.read_text() == whole
        else:
            assert not target.exists()
            assert "is not a whole JSON object" in r.err.read_text()
