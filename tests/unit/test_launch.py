"""The per-rank launcher (``_launch.py``) and the fork server (``_standby._Zygote``), with real
processes and real signals but without torch or torchrun: an "agent" process hosts a fork
server exactly as a standby does after its go order, and each test runs the launcher the
way torchrun would (``python -S _launch.py SCRIPT ARGS``).

Both paths are covered: the worker forked by the server, and the fallback where the
launcher starts a fresh interpreter because no server can be reached.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from unbroken.common import events
from unbroken.common.procs import is_alive, parent_of, proc_state
from unbroken.elastic._attempt import LAUNCHER

pytestmark = pytest.mark.timeout(60)

# The agent: creates the server's socket, forks the server (which never returns here
# except inside a forked worker), reports "<name> <server pid>" and lives until stdin closes.
AGENT = textwrap.dedent("""
    import os, socket, sys
    from unbroken.elastic._standby import _Zygote, _run_worker
    name = "unbroken-test-" + os.urandom(6).hex()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\\0" + name)
    listener.listen(8)
    agent = os.getpid()
    pid = os.fork()
    if pid == 0:
        work = _Zygote(listener, agent, sys.argv[1], [], 0.0).serve()
        if work is None:
            os._exit(0)
        _run_worker(work, None)
    else:
        listener.close()
        print(name, pid, flush=True)
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
        def inner():
            raise ValueError("boom in the worker")
        inner()
    if what == "sleep":
        time.sleep(60)
""")


@pytest.fixture
def agent(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path / "zygote.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert p.stdout is not None
    name, zpid = p.stdout.readline().decode().split()
    try:
        yield name, int(zpid)
    finally:
        assert p.stdin is not None
        p.stdin.close()  # the agent exits; the server follows once its workers are gone
        p.wait(10)
        deadline = time.monotonic() + 10
        while is_alive(int(zpid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not is_alive(int(zpid)), "the fork server outlived its agent"
        p.stdout.close()


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
    assert "_standby.py" not in err and "runpy" not in err, err
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


@pytest.mark.parametrize("zygote", [None, "unbroken-test-nobody-listens"])
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
    assert e["via"] == "spawn" and "PYTHONHASHSEED differ" in r.err.read_text()


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
