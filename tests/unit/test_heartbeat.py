"""The heartbeat beacons and watchdog helpers: beats from real processes, stall and hang
detection, stack dumps from a real stopped process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from unbroken.common import events
from unbroken.elastic import heartbeat
from unbroken.elastic.heartbeat import BeatRecord

pytestmark = pytest.mark.timeout(60)


_CHILD = textwrap.dedent("""
    import os, sys, time
    from unbroken.elastic import beat, heartbeat
    def deep_sleep_here():
        print("inside", flush=True)  # the handshake: this frame is now on the stack
        while True:
            time.sleep(0.05)
    for step in range(1, int(sys.argv[1]) + 1):
        beat(step)
    print("ready", heartbeat._beacon is not None, flush=True)
    if sys.argv[2] == "sleep":
        deep_sleep_here()
""")


def _child(tmp_path, steps: int, then: str, **env: str) -> subprocess.Popen[str]:
    """A process that beats ``steps`` times; asserts whether it created a beacon."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    e.update(env)
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(steps), then], env=e, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    supervised = events.ENV_RUN_DIR in env
    assert p.stdout.readline().split() == ["ready", str(supervised)]
    return p


def test_beats_from_a_real_process_and_catch_up_mark(tmp_path):
    env = {
        events.ENV_RUN_DIR: str(tmp_path),
        events.ENV_ATTEMPT: "3",
        "RANK": "0",
        events.ENV_CATCHUP: "40",
    }
    p = _child(tmp_path, 50, "exit", **env)
    p.wait(10)
    (b,) = heartbeat.read_beats(str(tmp_path), 3)
    # 50 beats, then finishing() at interpreter exit
    assert (b.pid, b.rank, b.attempt, b.step, b.seq) == (p.pid, 0, 3, 50, 51)
    assert abs(time.time() - b.t) < 10 and b.finished >= b.t
    (c,) = [e for e in events.load_events(str(tmp_path)) if e["event"] == "caught_up"]
    assert (c["step"], c["attempt"]) == (40, 3)


def test_beat_is_a_noop_when_unsupervised(tmp_path):
    p = _child(tmp_path, 5, "exit")  # asserts the child made no beacon
    assert p.wait(10) == 0


def test_beat_costs_about_a_microsecond(tmp_path, monkeypatch):
    monkeypatch.setenv(events.ENV_RUN_DIR, str(tmp_path))
    monkeypatch.setenv(events.ENV_ATTEMPT, "0")
    heartbeat._reset_after_fork()
    try:
        heartbeat.beat(0)
        n = 200_000
        t0 = time.perf_counter()
        for i in range(n):
            heartbeat.beat(i)
        per_call = (time.perf_counter() - t0) / n
    finally:
        heartbeat._reset_after_fork()
    print(f"beat(): {per_call * 1e6:.2f} us per call")
    assert per_call < 5e-6  # typically ~0.4 us; generous for a loaded CI box
    (b,) = heartbeat.read_beats(str(tmp_path), 0)
    assert b.step == n - 1


def test_stalled_considers_only_live_started_beacons():
    now = time.time()
    me = os.getpid()
    beats = [
        BeatRecord("a", me, 0, 0, 5, 10, now - 10.0),  # live and silent for 10 s
        BeatRecord("b", me, 1, 0, 5, 10, now - 0.5),  # live and recent
        BeatRecord("c", 2**22 + 7, 2, 0, 5, 10, now - 99.0),  # dead process: not a hang
        BeatRecord("d", me, 3, 0, 0, -1, 0.0),  # installed, never beat: startup timeout's job
    ]
    assert [b.rank for b in heartbeat.stalled(beats, now, hang_timeout=3.0)] == [0]


def _until(cond, what: str, timeout: float = 30.0):
    """Poll ``cond()`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
    return got


def test_stack_dump_from_a_stopped_process(tmp_path):
    """Issue 12 item 13: every step waits for its condition (the child inside the function,
    the stop in effect, the dump complete), so a loaded box only makes it slower."""
    from unbroken.common.procs import proc_state

    token = ("UNBROKEN_ATTEMPT_TOKEN", "t-stack")  # only the attempt's processes are asked
    env = {events.ENV_RUN_DIR: str(tmp_path), events.ENV_ATTEMPT: "0", "RANK": "4"}
    p = _child(tmp_path, 3, "sleep", **env, **dict([token]))
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "inside"
        os.kill(p.pid, signal.SIGSTOP)
        _until(lambda: proc_state(p.pid) == "T", "the child to be stopped")
        beats = heartbeat.read_beats(str(tmp_path), 0)
        dumps = heartbeat.request_stack_dumps(str(tmp_path), beats, grace=30.0, token=token)
        assert dumps == [os.path.join(heartbeat.stack_dir(str(tmp_path)), f"a0-r4-p{p.pid}.txt")]

        # the dump is non-empty once it has started; it is complete once the frame is in it
        def dumped() -> str:
            with open(dumps[0]) as f:
                t = f.read()
            return t if "deep_sleep_here" in t else ""

        text = _until(dumped, "deep_sleep_here in the stack dump")
        assert "most recent call first" in text
    finally:
        p.kill()
        p.wait(10)


def test_a_hang_is_dated_by_the_hung_ranks_last_beat():
    """A hang's detect phase is never shorter than the hang timeout (test_supervisor's
    SIGSTOP test once read 5.999 s for a 6 s timeout): the hang began when the hung rank
    last beat, not when a healthy rank last did (it beats once more, then waits in the
    collective)."""
    rec, me = heartbeat.BeatRecord, os.getpid()  # live pids: stalled() asks
    stopped = rec("r1.beat", me, 1, 0, seq=8, step=8, t=100.0)
    waiting = rec("r0.beat", me, 0, 0, seq=9, step=9, t=100.04)
    now = 106.01  # the first poll after the stopped rank's beat aged past 6 s
    hung = heartbeat.stalled([stopped, waiting], now, 6.0)
    assert hung == [stopped]
    began = heartbeat.hang_began([stopped, waiting], hung)
    assert began == 100.0 and now - began >= 6.0
    never = rec("r2.beat", me, 2, 0, seq=0, step=-1, t=0.0)  # stuck before its first beat
    assert heartbeat.hang_began([never, waiting], [never]) == 100.04
    assert heartbeat.hang_began([never], [never]) is None


def test_a_rank_that_said_its_loop_ended_gets_the_finish_timeout_from_then():
    """A rank saving and exiting after its last step is not a hang until the finish timeout
    (``--shutdown-timeout``, at least ``--hang-timeout``) has passed since it said so (the
    node-loss drill's kept ranks were declared hung 4 s after their last beat while they
    tore down, and the dump request killed them with -SIGUSR2)."""
    rec, me = heartbeat.BeatRecord, os.getpid()
    ending = rec("r0.beat", me, 0, 0, seq=21, step=20, t=100.0, finished=101.0)
    training = rec("r1.beat", me, 1, 0, seq=20, step=20, t=100.0)
    now = 106.0  # 6 s after both last beat: past a 4 s hang timeout
    assert heartbeat.stalled([ending, training], now, 4.0, finish_timeout=30.0) == [training]
    assert heartbeat.stalled([ending], 131.5, 4.0, finish_timeout=30.0) == [ending]
    assert heartbeat.stalled([ending], 104.5, 4.0) == []  # never less than the hang timeout
    assert heartbeat.stalled([ending], 105.5, 4.0) == [ending]
    assert heartbeat.hang_began([ending], [ending]) == 101.0


_ENDING = textwrap.dedent("""
    import faulthandler, os, signal, sys
    from unbroken.elastic import beat, finishing, heartbeat
    beat(1)
    beat(2)
    finishing()
    print("finished", flush=True)
    sys.stdin.readline()  # the parent has read the beacon
    beat(3)  # training again: finishing() is taken back
    print("beat", flush=True)
    sys.stdin.readline()
    # What the interpreter's finalization does: faulthandler restores what it found. A
    # request for stacks arriving then is ignored instead of killing the process.
    faulthandler.unregister(heartbeat.DUMP_SIGNAL)
    os.kill(os.getpid(), heartbeat.DUMP_SIGNAL)
    print("alive", flush=True)
""")


def test_finishing_is_recorded_taken_back_by_a_beat_and_a_late_dump_request_is_harmless(
    tmp_path,
):
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    env.update({events.ENV_RUN_DIR: str(tmp_path), events.ENV_ATTEMPT: "0", "RANK": "0"})
    p = subprocess.Popen(
        [sys.executable, "-c", _ENDING],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "finished"
        (b,) = heartbeat.read_beats(str(tmp_path), 0)
        assert (b.step, b.seq) == (2, 3) and b.finished >= b.t > 0, b
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "beat"
        (b,) = heartbeat.read_beats(str(tmp_path), 0)
        assert (b.step, b.finished) == (3, 0.0), b
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "alive"
        assert p.wait(30) == 0
    finally:
        p.kill()
        p.wait(10)
    (b,) = heartbeat.read_beats(str(tmp_path), 0)
    assert b.step == 3 and b.finished >= b.t, b  # its interpreter's exit said finishing() too
