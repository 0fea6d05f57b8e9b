"""An agent dies with the `unbroken run` that started it (E-NO-ORPHANS): real processes,
the kernel's ``PR_SET_PDEATHSIG``, and the check that covers a supervisor gone before it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from unbroken.common import events

CHILD = (
    "import signal, sys, time\n"
    "from unbroken.elastic.launch.forkserver import die_with_supervisor\n"
    "die_with_supervisor(signal.SIGTERM)\n"
    "print('alive', flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


def _env(supervisor: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != events.ENV_SUPERVISOR}
    if supervisor is not None:
        env[events.ENV_SUPERVISOR] = supervisor
    return env


def test_an_agent_whose_supervisor_is_already_gone_ends_at_once() -> None:
    # the supervisor named is not its parent: it died before the call (the child was adopted)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, "30"], env=_env("1"), capture_output=True, timeout=60
    )
    assert p.returncode == -signal.SIGTERM and b"alive" not in p.stdout


def test_an_agent_of_a_live_supervisor_lives_and_one_started_by_hand_is_left_alone() -> None:
    for who in (str(os.getpid()), None):
        p = subprocess.run(
            [sys.executable, "-c", CHILD, "0"], env=_env(who), capture_output=True, timeout=60
        )
        assert p.returncode == 0 and p.stdout == b"alive\n", (who, p)


def test_an_agent_gets_sigterm_when_its_supervisor_dies_later(tmp_path) -> None:
    pid_file = tmp_path / "agent.pid"
    supervisor = (
        "import os, subprocess, sys\n"
        f"env = dict(os.environ, {events.ENV_SUPERVISOR}=str(os.getpid()))\n"
        f"a = subprocess.Popen([sys.executable, '-c', {CHILD!r}, '60'], env=env,\n"
        "                      stdout=subprocess.PIPE)\n"
        "assert a.stdout.readline() == b'alive\\n'\n"
        f"open({str(pid_file)!r}, 'w').write(str(a.pid))\n"
        "os._exit(0)  # killed outright: no clean-up\n"
    )
    subprocess.run([sys.executable, "-c", supervisor], env=_env(None), timeout=60, check=True)
    agent = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(agent, 0)
        except ProcessLookupError:
            return  # gone (reaped by init)
        with open(f"/proc/{agent}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return  # dead, not yet reaped
        time.sleep(0.05)
    os.kill(agent, signal.SIGKILL)
    raise AssertionError("the agent outlived its supervisor by 30 s")
