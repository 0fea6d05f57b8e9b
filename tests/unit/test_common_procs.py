"""The one /proc/<pid>/stat parser: state and parent of real processes, hostile names too."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from unbroken.common.procs import is_alive, parent_of, proc_state


def _wait_state(pid: int, want: str, deadline: float = 10.0) -> str | None:
    end = time.monotonic() + deadline
    st = proc_state(pid)
    while st != want and time.monotonic() < end:
        time.sleep(0.01)
        st = proc_state(pid)
    return st


def test_a_command_name_with_parentheses_and_fields_in_it(tmp_path) -> None:
    # comm "x) R 1 (y": a parser that stops at the first ')' reads state R and parent 1
    exe = tmp_path / "x) R 1 (y"
    exe.symlink_to("/bin/sleep")
    p = subprocess.Popen([str(exe), "30"])
    try:
        assert _wait_state(p.pid, "S") == "S"
        assert parent_of(p.pid) == os.getpid() and is_alive(p.pid)
        p.send_signal(signal.SIGSTOP)
        assert _wait_state(p.pid, "T") == "T"
        p.kill()
        assert _wait_state(p.pid, "Z") == "Z"  # not reaped yet: a zombie is not alive
        assert not is_alive(p.pid) and parent_of(p.pid) == os.getpid()
    finally:
        p.kill()
        p.wait()
    assert proc_state(p.pid) is None and parent_of(p.pid) is None and not is_alive(p.pid)


def test_self() -> None:
    assert proc_state(os.getpid()) == "R" and parent_of(os.getpid()) == os.getppid()
