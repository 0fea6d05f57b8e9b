"""``peer_failed()``: how `unbroken run` tells the ranks that outlived a failed one that their
group is being stopped, and the Checkpointer's SIGTERM handler skipping a save that could
never finish (its collectives would wait on the dead rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from unbroken.common import events
from unbroken.elastic import peer_failed

pytestmark = pytest.mark.timeout(120)

JOB = textwrap.dedent("""
    import sys, time, torch
    from unbroken.ckpt import Checkpointer, TrainState
    model = torch.nn.Linear(2, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = Checkpointer(sys.argv[1], state, every_steps=10_000, save_on_sigterm=True)
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        state.step = step
        ckpt.maybe_save(step)
        time.sleep(0.01)
""")


def test_peer_failed_reads_the_attempts_marker(tmp_path, monkeypatch):
    monkeypatch.delenv(events.ENV_RUN_DIR, raising=False)
    assert peer_failed() is None  # not supervised
    monkeypatch.setenv(events.ENV_RUN_DIR, str(tmp_path))
    monkeypatch.setenv(events.ENV_ATTEMPT, "2")
    assert peer_failed() is None
    d = events.attempt_dir(str(tmp_path), 2)
    os.makedirs(d)
    with open(os.path.join(d, events.PEER_FAILED_FILE), "w") as f:
        f.write("rank 1 (pid 9) died of SIGKILL\n")
    assert peer_failed() == "rank 1 (pid 9) died of SIGKILL"
    monkeypatch.setenv(events.ENV_ATTEMPT, "3")  # another attempt's marker is not ours
    assert peer_failed() is None


@pytest.mark.parametrize("peer_dead", [True, False])
def test_checkpointer_skips_the_sigterm_save_when_a_peer_died(tmp_path, peer_dead):
    run_dir, root = tmp_path / "run", tmp_path / "ckpt"
    d = events.attempt_dir(str(run_dir), 0)
    os.makedirs(d)
    if peer_dead:
        with open(os.path.join(d, events.PEER_FAILED_FILE), "w") as f:
            f.write("rank 1 died\n")
    env = dict(os.environ, **{events.ENV_RUN_DIR: str(run_dir), events.ENV_ATTEMPT: "0"})
    p = subprocess.Popen(
        [sys.executable, "-c", JOB, str(root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline() == b"ready\n"
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 143
    saved = [n for n in (os.listdir(root) if root.is_dir() else []) if n.startswith("step-")]
    if peer_dead:
        assert saved == []  # left at once: no collective save attempted
    else:
        assert len(saved) == 1  # an ordinary preemption still saves
    p.stdout.close()
    p.stderr.close()
