"""The supervisors' rendezvous store when its host stops answering: torch's TCPStore client
waits for an answer without bound (its ``timeout`` covers connecting and waiting for a key,
not a host that took the connection and went silent). Seen: a supervisor joining an
endpoint where a program accepted and never answered sat in ``TCPStore.ping`` forever,
deaf to SIGTERM (its Python handler never ran); a joined supervisor whose host was
SIGSTOPped sat in ``compare_set`` forever: its workers' hangs went undetected. Real
TCPStores on 127.0.0.1, a real SIGSTOP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from unbroken.common.procs import proc_state
from unbroken.elastic.rendezvous import Coordinator

pytestmark = pytest.mark.timeout(90)

_HOST = """
import sys, time
from unbroken.common.procs import proc_state
from unbroken.elastic.rendezvous import Coordinator
c = Coordinator("127.0.0.1", 0, "job", "host", connect_timeout=30.0)
print(c.port, flush=True)
time.sleep(300)
"""


def _freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped (the signal lands
    later: on a busy box the store's thread answered one more call first)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30.0
    while not all(proc_state(int(t)) == "T" for t in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"process {pid} never stopped"
        time.sleep(0.01)


def test_joining_an_endpoint_that_never_answers_gives_up_within_the_join_timeout():
    with socket.socket() as squatter:  # takes connections (the kernel's backlog), says nothing
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}") as e:
            Coordinator("127.0.0.1", port, "job", "b", connect_timeout=2.0)
        took = time.monotonic() - t0
    assert took < 30.0, f"gave up after {took:.1f} s, --join-timeout was 2 s"
    assert "--rdzv-endpoint" in str(e.value), e.value  # says what to check


def test_a_joined_store_whose_host_freezes_fails_its_calls_and_serves_again_once_it_thaws():
    host = subprocess.Popen([sys.executable, "-c", _HOST], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        coord = Coordinator("127.0.0.1", port, "job", "b", connect_timeout=30.0, call_timeout=1.0)
        coord.tick()
        assert "host" in coord.peers()
        _freeze(host.pid)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="no answer from the rendezvous store"):
            coord.gen()  # a read: a `set` is sent without waiting for its answer
        assert time.monotonic() - t0 < 20.0
        t1 = time.monotonic()  # the unanswered call still holds the connection: the next
        with pytest.raises(RuntimeError, match="still waits for an answer"):  # fails at once
            coord.tick()
        assert time.monotonic() - t1 < 0.5
        os.kill(host.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30.0
        while True:  # the host answers the call it held, and the store serves again
            try:
                coord.get_stop()
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "the store never served again after SIGCONT"
                time.sleep(0.05)
        assert coord.gen() == 0 and coord.get_stop() is None
    finally:
        host.kill()
        host.wait()
