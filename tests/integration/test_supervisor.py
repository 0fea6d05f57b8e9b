"""`unbroken run` end to end: real torchrun agents on 127.0.0.1, real gloo workers, real
SIGKILL / SIGSTOP, a real storage outage, a real deterministic bug.

Each test starts the supervisor as a subprocess and, whatever happens, kills every process
it started (see scripts/elastic_harness.py).
"""

from __future__ import annotations

import os
import signal
import time

import elastic_harness as h
import pytest

pytestmark = pytest.mark.timeout(240)


_script_args = h.script_args


def _assert_continuous(path: str, steps: int, world: int | None = None) -> None:
    got = h.metric_steps(path)
    assert got == list(range(1, steps + 1)), f"metric log steps not 1..{steps} once each: {got}"
    if world is not None:  # and bit-identical to an uninterrupted run
        losses = [r["loss"] for r in h.metrics(path)]
        assert losses == h.reference_losses(steps, world)


def _assert_master_port_held(job: h.Job, attempts: int) -> None:
    """Rank 0 of every attempt found its MASTER_PORT held by the agent until it hosted the
    group's store (a fresh agent, a standby, a kept agent: no other socket could take it)."""
    held = [(e["attempt"], e["master_port_held"]) for e in job.events("startup") if e["rank"] == 0]
    assert held == [(n, True) for n in range(attempts)], held


def _assert_nothing_left(job: h.Job) -> None:
    assert not h.pids_of(job), "processes of the job outlived its supervisor"
    assert not h.empty_dumps(job.run_dir), "empty stack-dump files left behind"


def _survivor_stopped_by_us(job: h.Job, attempt: int, victim_rank: int) -> dict:
    """The rank that outlived the killed one ended because the supervisor stopped it: its
    launcher was told to stop before it ended, right after the supervisor's stop began."""
    (stop,) = [e for e in job.events("stop_group") if e["attempt"] == attempt]
    assert f"rank {victim_rank}" in stop["reason"] and "SIGKILL" in stop["reason"], stop
    survivors = [
        e for e in job.events("worker_exit") if e["attempt"] == attempt and e["rank"] != victim_rank
    ]
    assert sorted(stop["exited"] + stop["killed"]) == [0], stop
    for e in survivors:
        assert e["stopped"] is True, e
    return stop


def test_sigkill_worker_restarts_from_checkpoint_with_measured_phases(tmp_path):
    steps = 40
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            # a generous grace: rank 0 must leave by itself (peer_failed), not by SIGKILL
            ["--nproc-per-node", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--stop-grace", "5"],
            _script_args(tmp_path, steps, save_every=5),
        )
        beats = h.wait_until(lambda: h.live_beats(job, 0, 12, ranks=2), 90, "step 12", job)
        victim = beats[1]
        t_kill = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        h.wait_until(lambda: h.live_beats(job, 1, 1, ranks=2), 90, "the restarted ranks", job)
        # nothing of the stopped attempt, the standby or the new one waits unreaped
        h.wait_until(lambda: not h.zombies_below(job.proc.pid), 10, "no zombies", job)
        assert job.wait(90) == 0, job.output()[-3000:]

    fails = job.events("failure")
    assert len(fails) == 1
    f = fails[0]
    assert (f["fault"], f["rule"], f["action"], f["kind"]) == (
        "process",
        "killed",
        "restart",
        "exit",
    )
    assert "SIGKILL" in f["reason"] and "rank 1" in f["reason"]
    assert abs(f["t_fail"] - t_kill) < 1.0, (f["t_fail"], t_kill)
    # rank 0 honoured peer_failed() on our SIGTERM instead of waiting on its dead peer
    stop = _survivor_stopped_by_us(job, 0, victim_rank=1)
    assert stop["exited"] == [0] and not stop["killed"], stop
    # both attempts' workers were forked by the pre-warmed agents' fork servers
    exits = job.events("worker_exit")
    assert {e["via"] for e in exits} == {"zygote"} and len(exits) == 4, exits
    assert [e["prewarmed"] is not None for e in job.events("launch")] == [True, True]
    # attempt 0's agent started before the store and the pre-flight checks: its imports ran
    # while they did (time to the first step 2.9 -> 2.1 s, benchmarks/RESULTS.md)
    (began,) = job.events("start")
    first = job.events("launch")[0]
    assert first["t"] - first["prewarmed"] < began["t"], (first, began)
    # The restart resumed from a checkpoint at or after step 10, not from scratch.
    loaded = [e for e in job.events("loaded") if e["attempt"] == 1]
    assert loaded and 10 <= loaded[0]["step"] <= f["step"]
    caught = [e for e in job.events("caught_up") if e["attempt"] == 1]
    assert caught and caught[0]["step"] >= f["step"]

    (rec,) = job.recoveries()
    assert 0 <= rec["detect"] < 1.5  # a worker seen dead at the next 0.1 s poll
    assert 0 < rec["relaunch"] < 30.0
    assert 0 < rec["load"] < 30.0
    assert 0 <= rec["catch_up"] < 30.0
    assert rec["total"] == pytest.approx(
        rec["detect"] + rec["relaunch"] + rec["load"] + rec["catch_up"]
    )
    assert rec["restore_seconds"] is not None and rec["restore_seconds"] < rec["load"]
    print(
        "SIGKILL recovery phases:",
        {k: rec[k] for k in ("detect", "relaunch", "load", "catch_up", "total")},
    )
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps, world=2)
    assert "recovery phases (seconds)" in job.output()
    assert "survive signal" not in job.output()  # no false alarm from a clean finish
    _assert_nothing_left(job)


def test_survivor_stuck_after_its_peer_died_is_killed_after_the_grace(tmp_path):
    """The rank left alive cannot finish its collective and ignores SIGTERM (like a rank
    stuck in a save it can never finish): it costs --stop-grace, not torchrun's 30 s
    shutdown timeout. Fresh interpreters and nothing held ahead (--no-standby, before issue
    23 --no-prewarm); since issue 23 the running agent is kept and restarts the workers."""
    steps = 30
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2", "--stop-grace", "1", "--no-standby"],
            _script_args(tmp_path, steps, save_every=5, linger=120),
        )
        beats = h.wait_until(lambda: h.live_beats(job, 0, 8, ranks=2), 90, "step 8", job)
        os.kill(beats[1].pid, signal.SIGKILL)
        assert job.wait(120) == 0, job.output()[-3000:]

    stop = _survivor_stopped_by_us(job, 0, victim_rank=1)
    assert stop["killed"] == [0] and stop["grace"] == 1, stop
    assert stop["seconds"] < 8.0, stop  # SIGKILLed at the grace, not waited on
    (f,) = job.events("failure")
    relaunched = [e for e in job.events("launch") if e["attempt"] == 1]
    assert relaunched and relaunched[0]["t"] - f["t_detect"] < 10.0
    assert (f["rule"], f["fault"]) == ("killed", "process"), f
    exits = job.events("worker_exit")
    assert {e["via"] for e in exits} == {"spawn"}, exits
    assert [e["kept"] for e in job.events("launch")] == [False, True]
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps, world=2)
    _assert_nothing_left(job)


def test_no_standby_holds_nothing_and_restarts_the_workers_in_the_running_agent(tmp_path):
    """issue 23 (cold path): --no-standby holds no process for the next attempt while the
    job trains, and a rank's failure costs what torchrun's own restart costs: the running
    agent (torch imported) is kept and starts fresh worker interpreters, instead of a
    fresh torchrun that imports torch again before it rendezvouses."""
    stop = tmp_path / "stop"
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2", "--no-standby"],
            _script_args(tmp_path, 10_000, save_every=5, stop_file=stop),
        )
        beats = h.wait_until(lambda: h.live_beats(job, 0, 8, ranks=2), 90, "step 8", job)
        assert not h.pids_of(job, attempt=1)  # nothing held for the next attempt
        os.kill(beats[1].pid, signal.SIGKILL)
        back = max(b.step for b in beats) + 2
        h.wait_until(lambda: h.live_beats(job, 1, back, ranks=2), 90, "the restarted ranks", job)
        stop.write_text("")
        assert job.wait(120) == 0, job.output()[-3000:]

    first, second = job.events("launch")
    assert (first["kept"], second["kept"]) == (False, True), (first, second)
    assert second["agent_pid"] == first["agent_pid"], (first, second)
    # the attempt's own agent said it was up; nothing was ever started ahead
    assert [e["attempt"] for e in job.events("standby")] == [0], job.events("standby")
    exits = job.events("worker_exit")
    assert {e["via"] for e in exits} == {"spawn"}, exits
    _assert_master_port_held(job, attempts=2)
    steps = h.metric_steps(str(tmp_path / "metrics.jsonl"))[-1]
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps, world=2)
    _assert_nothing_left(job)


def test_no_prewarm_holds_a_bare_agent_and_forks_the_restarted_workers_on_demand(tmp_path):
    """issue 23 item 2 (cold path): --no-prewarm holds only a bare agent for the next attempt
    while the job trains (torch and torchrun imported, no fork server, nothing preloaded);
    at the restart that agent forks a fork server (sharing its imported torch) which forks
    the restarted workers: the ranks of a node do not each import torch again.
    (Before item 2 the restarted workers were fresh interpreters: ``via == "spawn"``.)"""
    stop = tmp_path / "stop"
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2", "--no-prewarm"],
            _script_args(tmp_path, 10_000, save_every=5, stop_file=stop),
        )
        h.wait_until(
            lambda: [e for e in job.events("standby") if e["attempt"] == 1], 90, "standby", job
        )
        beats = h.wait_until(lambda: h.live_beats(job, 0, 8, ranks=2), 90, "step 8", job)
        held = h.pids_of(job, attempt=1)
        assert len(held) == 1, held  # the bare agent only: no fork server while training
        os.kill(beats[1].pid, signal.SIGKILL)
        back = max(b.step for b in beats) + 2
        h.wait_until(lambda: h.live_beats(job, 1, back, ranks=2), 90, "the restarted ranks", job)
        stop.write_text("")
        assert job.wait(120) == 0, job.output()[-3000:]

    (sb,) = [e for e in job.events("standby") if e["attempt"] == 1]
    assert sb["fork_server"] is False, sb
    _assert_master_port_held(job, attempts=2)
    launches = job.events("launch")
    assert [e["prewarmed"] is not None for e in launches] == [True, True], launches
    assert "--bare" in launches[1]["argv"] and launches[1]["agent_pid"] == held[0]
    exits = [e for e in job.events("worker_exit") if e["attempt"] == 1]
    assert len(exits) == 2 and {e["via"] for e in exits} == {"zygote"}, exits
    (f,) = job.events("failure")
    assert (f["fault"], f["action"]) == ("process", "restart"), f
    steps = h.metric_steps(str(tmp_path / "metrics.jsonl"))[-1]
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps, world=2)
    _assert_nothing_left(job)


def _gated_job(start, tmp_path, standby_start: str) -> h.Job:
    """2 ranks held before their process group until ``tmp_path/gate`` exists; they stop
    when ``tmp_path/stop`` does."""
    return start(
        str(tmp_path / "run"),
        ["--nproc-per-node", "2", "--standby-start", standby_start],
        _script_args(
            tmp_path,
            10_000,
            save_every=5,
            stop_file=tmp_path / "stop",
            start_gate=tmp_path / "gate",
        ),
    )


def test_standby_started_at_launch_exists_before_the_first_beat_and_takes_an_agent_loss(
    tmp_path,
):
    """issue 23 item 1 (cold path): with --standby-start launch the next attempt's standby is
    started with the attempt, before any rank has beaten; when the attempt's agent is lost
    before the first beat, the restart is run by that standby (not a cold agent started
    then), and the job finishes bit-identical with nothing left."""
    gate, stop = tmp_path / "gate", tmp_path / "stop"
    with h.jobs() as start:
        job = _gated_job(start, tmp_path, "launch")
        standby = h.wait_until(lambda: h.pids_of(job, attempt=1), 90, "the standby", job)
        (first,) = h.wait_until(lambda: job.events("launch"), 90, "the first launch", job)
        assert not h.live_beats(job, 0, 1, ranks=1)  # no rank has beaten (the gate is shut)
        os.kill(first["agent_pid"], signal.SIGKILL)
        h.wait_until(lambda: len(job.events("launch")) == 2, 90, "the restart", job)
        gate.write_text("")
        h.wait_until(lambda: h.live_beats(job, 1, 8, ranks=2), 90, "step 8", job)
        stop.write_text("")
        assert job.wait(120) == 0, job.output()[-3000:]

    (f,) = job.events("failure")
    assert f["kind"] == "agent_lost", f  # (filed as a lost node: relaunched)
    second = job.events("launch")[1]
    assert second["agent_pid"] in standby and not second["kept"], (second, standby)
    steps = h.metric_steps(str(tmp_path / "metrics.jsonl"))[-1]
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps, world=2)
    _assert_nothing_left(job)


def test_standby_start_beat_waits_for_every_rank_to_beat(tmp_path):
    """issue 23 item 1: --standby-start beat (auto's choice on a node without a spare CPU
    for the standby: its imports would slow the job's own start) starts no standby before
    every local rank has beaten, and one after."""
    gate, stop = tmp_path / "gate", tmp_path / "stop"
    with h.jobs() as start:
        job = _gated_job(start, tmp_path, "beat")
        h.wait_until(lambda: job.events("standby"), 90, "the first attempt's agent", job)
        h.wait_until(lambda: len(h.pids_of(job, attempt=0)) >= 4, 90, "the workers", job)
        assert not h.pids_of(job, attempt=1)  # gate shut: nobody beat, no standby yet
        gate.write_text("")
        h.wait_until(lambda: h.pids_of(job, attempt=1), 90, "the standby after the beats", job)
        stop.write_text("")
        assert job.wait(120) == 0, job.output()[-3000:]
    _assert_nothing_left(job)


_SLOW_PRELOAD = """
import os, time
# A preload that never finishes in a standby (attempt >= 1) until the test opens the gate:
# the next attempt's standby stays 'not ready' for as long as the test wants.
if os.environ.get("UNBROKEN_ATTEMPT", "0") != "0":
    gate, deadline = os.environ["UB_TEST_GATE"], time.monotonic() + 300
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_failure_before_the_standby_is_ready_restarts_the_workers_in_the_kept_agent(
    tmp_path, monkeypatch
):
    """issue 23 (cold path): a rank dies while the next attempt's standby is still importing.
    The restart neither waits for that standby nor starts a cold agent: the failed attempt's
    agent (torch imported, its fork server warm) is kept and restarts only the workers, forked
    as before. The unready standby is dismissed; the job ends bit-identical, nothing left."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "ub_slow_preload.py").write_text(_SLOW_PRELOAD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("UB_TEST_GATE", str(tmp_path / "gate"))
    stop = tmp_path / "stop"
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2", "--preload", "ub_slow_preload"],
            _script_args(tmp_path, 10_000, save_every=5, stop_file=stop),
        )
        h.wait_until(lambda: h.pids_of(job, attempt=1), 90, "the standby of attempt 1", job)
        beats = h.wait_until(lambda: h.live_beats(job, 0, 6, ranks=2), 90, "step 6", job)
        assert not [e for e in job.events("standby") if e["attempt"] == 1]  # not ready
        os.kill(beats[1].pid, signal.SIGKILL)
        back = max(b.step for b in beats) + 2
        h.wait_until(lambda: h.live_beats(job, 1, back, ranks=2), 90, "the restarted ranks", job)
        stop.write_text("")
        assert job.wait(120) == 0, job.output()[-3000:]
        (tmp_path / "gate").write_text("")

    (f,) = job.events("failure")
    assert (f["fault"], f["action"]) == ("process", "restart"), f
    first, second = job.events("launch")
    assert (first["kept"], second["kept"]) == (False, True), (first, second)
    assert second["agent_pid"] == first["agent_pid"], (first, second)
    assert second["prewarmed"] is not None, second
    exits = [e for e in job.events("worker_exit") if e["attempt"] == 1]
    assert len(exits) == 2 and {e["via"] for e in exits} == {"zygote"}, exits
    assert not [e for e in job.events("standby") if e["attempt"] == 1]  # never used
    steps = h.metric_steps(str(tmp_path / "metrics.jsonl"))[-1]
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps, world=2)
    _assert_nothing_left(job)


def test_single_rank_sigkill_is_a_process_fault_not_a_lost_peer(tmp_path):
    """Old peer-error text in the rank's stderr (here printed at start) did not kill it.
    Also: the standby prepared for the restart died before it was needed; the supervisor
    starts another one instead of failing the restart."""
    steps = 20
    noise = "ConnectionResetError: [Errno 104] Connection reset by peer"
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "1"],
            _script_args(tmp_path, steps, save_every=5, stderr_noise=noise),
        )
        beats = h.wait_until(lambda: h.live_beats(job, 0, 6, ranks=1), 90, "step 6", job)
        standby = h.wait_until(lambda: h.pids_of(job, attempt=1), 90, "the standby", job)
        for pid in standby:  # the standby and its fork server
            os.kill(pid, signal.SIGKILL)
        os.kill(beats[0].pid, signal.SIGKILL)
        assert job.wait(90) == 0, job.output()[-3000:]
    (f,) = job.events("failure")
    assert (f["fault"], f["rule"], f["action"]) == ("process", "killed", "restart"), f
    relaunch = [e for e in job.events("launch") if e["attempt"] == 1]
    assert relaunch and relaunch[0]["agent_pid"] not in standby
    (stop,) = job.events("stop_group")
    assert stop["exited"] == stop["killed"] == [], stop  # nobody else to stop
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps, world=1)
    _assert_nothing_left(job)


def test_sigstop_worker_is_a_hang_with_stack_dumps(tmp_path):
    steps = 30
    # Long enough that a loaded 2-core box never stalls a healthy step (a save's fsync) for
    # that long: at 3 s, the relaunched attempt was sometimes declared hung as well.
    hang_s = 6.0
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2", "--hang-timeout", str(hang_s)],
            _script_args(tmp_path, steps, save_every=4),
        )
        beats = h.wait_until(lambda: h.live_beats(job, 0, 8, ranks=2), 90, "step 8", job)
        t_stop = time.time()
        os.kill(beats[1].pid, signal.SIGSTOP)
        hang = h.wait_until(lambda: job.events("hang"), 30, "hang event", job)[0]
        assert hang["t_detect"] - t_stop <= hang_s + 2.0, "not detected within hang-timeout + 2 s"
        assert job.wait(90) == 0, job.output()[-3000:]

    assert hang["ranks"], hang
    dumps = {os.path.basename(p): open(p).read() for p in hang["stacks"]}
    assert len(dumps) == 2, hang["stacks"]  # the stopped worker dumps too (SIGCONT after ask)
    for name, text in dumps.items():
        assert "elastic_train.py" in text and "most recent call first" in text, (name, text)
    (f,) = job.events("failure")
    assert (f["fault"], f["rule"], f["kind"]) == ("process", "hang", "hang")
    (rec,) = job.recoveries()
    assert hang_s <= rec["detect"] < 2 * hang_s  # a hang costs the hang timeout to detect
    assert rec["relaunch"] is not None and rec["load"] is not None
    # one step everywhere: the message, the failure record and the summary table
    assert hang["detail"].endswith(f"at step {hang['step']}"), hang
    assert f["step"] == hang["step"] == rec["step_at_failure"], (f, hang, rec)
    table = next(ln for ln in job.output().splitlines() if ln.split()[:3] == ["0", "0", "process"])
    assert table.split()[3] == str(hang["step"]), table
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps)
    _assert_nothing_left(job)


def test_ranks_that_said_their_loop_ended_are_not_hung_while_they_save_and_exit(tmp_path):
    """After the last step the ranks call ``finishing()`` and take more than twice the hang
    timeout to exit (a final save, a slow teardown): no hang, no restart; the finish timeout
    is ``--shutdown-timeout``. Before, the node-loss drill's ranks were declared hung 4 s
    after their last beat while they tore down, and the stack-dump request killed them."""
    hang_s, steps = 5.0, 4
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "2", "--hang-timeout", str(hang_s), "--shutdown-timeout", "60"],
            _script_args(tmp_path, steps, save_every=2, final_wait=2.2 * hang_s),
        )
        assert job.wait(120) == 0, job.output()[-3000:]
    assert job.events("hang") == [] and job.events("failure") == [], job.output()[-3000:]
    assert [e["attempt"] for e in job.events("launch")] == [0]
    beats = job.beats(0)
    assert len(beats) == 2 and all(b.step == steps and b.finished >= b.t for b in beats), beats
    assert all(e["exitcode"] == 0 for e in job.events("worker_exit")), job.events("worker_exit")
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps)
    _assert_nothing_left(job)


def test_same_exception_at_same_step_twice_stops_with_report(tmp_path):
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "1"],
            _script_args(tmp_path, 20, save_every=5, raise_at=7, ckpt_kind="unbroken"),
        )
        assert job.wait(90) == 3, job.output()[-3000:]

    launches = job.events("launch")
    assert len(launches) == 2, "must stop after the second identical failure"
    f1, f2 = job.events("failure")
    assert f1["action"] == "restart" and f1["step"] == 6 and "boom at step 7" in f1["reason"]
    assert f2["action"] == "stop" and f2["fault"] == "deterministic"
    assert f1["signature"] == f2["signature"] and "ValueError: boom at step 7" in f1["signature"]
    # the real Checkpointer reported its restore to the supervisor
    (loaded,) = [e for e in job.events("loaded") if e["attempt"] == 1]
    assert loaded["step"] == 5 and loaded["seconds"] >= 0
    report = open(os.path.join(job.run_dir, "stop-report.txt")).read()
    assert "same failure happened 2 times at step 6" in report
    assert "ValueError: boom at step 7" in report and "elastic_train.py" in report
    assert job.events("stop")[-1]["exit_code"] == 3


def test_storage_outage_waits_in_preflight_then_resumes(tmp_path):
    steps = 30
    ckpt = tmp_path / "ckpt"
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--nproc-per-node", "1", "--ckpt-dir", str(ckpt)],
            _script_args(tmp_path, steps, save_every=2, ckpt_kind="unbroken"),
        )
        h.wait_until(
            lambda: [e for e in job.events("saved") if e["step"] >= 4],
            90,
            "a checkpoint at step >= 4",
            job,
        )
        # The checkpoint root becomes unusable (a file where the directory was): root
        # cannot write through this, unlike a chmod.
        moved = tmp_path / "ckpt.away"
        os.rename(ckpt, moved)
        ckpt.write_text("not a directory")
        fail = h.wait_until(lambda: job.events("failure"), 30, "the failure", job)[0]
        bad = h.wait_until(
            lambda: [e for e in job.events("preflight") if not e["ok"] and e["t"] > fail["t"]][1:],
            30,
            "two failing pre-flights after the failure",
            job,
        )
        assert "ckpt_dir" in bad[0]["checks"][0]["name"]
        assert not [e for e in job.events("launch") if e["t"] > fail["t_detect"]], (
            "restarted while the storage was down"
        )
        ckpt.unlink()
        os.rename(moved, ckpt)
        assert job.wait(90) == 0, job.output()[-3000:]

    assert fail["fault"] == "storage" and fail["action"] == "preflight", fail
    assert len(job.events("launch")) == 2
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps)


def test_sigterm_lets_the_job_save_then_exits_7_and_a_rerun_resumes(tmp_path):
    steps = 40
    args = _script_args(tmp_path, steps, save_every=100)  # only the preemption save
    with h.jobs() as start:
        job = start(str(tmp_path / "run"), ["--nproc-per-node", "1"], args)
        h.wait_until(lambda: h.live_beats(job, 0, 8, ranks=1), 90, "step 8", job)
        t_term = time.time()
        os.kill(job.proc.pid, signal.SIGTERM)  # the scheduler preempts the job
        assert job.wait(30) == 7, job.output()[-3000:]
        (saved,) = job.events("saved")
        assert saved["preempted"] and saved["t"] > t_term and saved["step"] >= 8
        (f,) = job.events("failure")
        assert (f["fault"], f["action"], f["kind"]) == ("preemption", "exit", "preempted")
        assert not h.pids_of(job)  # nothing of the job survives

        again = start(str(tmp_path / "run"), ["--nproc-per-node", "1"], args)
        assert again.wait(90) == 0, again.output()[-3000:]
    (loaded,) = [e for e in again.events("loaded") if e["attempt"] == 1]
    assert loaded["step"] == saved["step"]  # resumed exactly where the preemption saved
    _assert_continuous(str(tmp_path / "metrics.jsonl"), steps)


def test_hang_before_the_first_step_hits_startup_timeout_then_stops(tmp_path):
    stuck = os.path.join(os.path.dirname(h.SCRIPT), "elastic_stuck.py")
    with h.jobs() as start:
        job = start(str(tmp_path / "run"), ["--startup-timeout", "2"], [], script=stuck)
        assert job.wait(90) == 3, job.output()[-3000:]  # the same hang twice: a bug, stop
    hangs = job.events("hang")
    assert len(hangs) == 2 and len(job.events("launch")) == 2
    for hang in hangs:
        (dump,) = hang["stacks"]
        assert "stuck_before_first_step" in open(dump).read()
    f1, f2 = job.events("failure")
    assert (f1["rule"], f1["action"], f2["fault"]) == ("hang", "restart", "deterministic")
    assert "2 times before the first step: hang" in f2["reason"]


def test_a_supervisor_killed_outright_takes_its_agents_and_workers_with_it(tmp_path):
    """`kill -9` of `unbroken run` (the OOM killer, an operator) runs none of its clean-up.
    Its agent, standby and workers must still end - with SIGTERM, so the ranks save on the
    way out - instead of training on unsupervised, writing the checkpoints a rerun of the
    job would write too. (One node: its agent also loses the rendezvous store the
    supervisor hosts; test_supervisor_nodes.py kills a node whose peer hosts it.)"""
    args = _script_args(tmp_path, 10_000, save_every=1000, stop_file=tmp_path / "stop")
    with h.jobs() as start:
        # one rank: elastic_train.py's own SIGTERM save is a single-rank one (its ranks do
        # not agree on a stopping step); the library's save_on_sigterm is tested elsewhere
        job = start(str(tmp_path / "run"), ["--nproc-per-node", "1"], args)
        h.wait_until(lambda: h.live_beats(job, 0, 3, ranks=1), 90, "step 3", job)
        h.wait_until(lambda: h.pids_of(job, attempt=1), 90, "the standby", job)
        t_kill = time.time()
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(10)
        h.wait_gone(job, 60, "the end of the job's processes after the kill")
    saved = [e for e in job.events("saved") if e["t"] > t_kill]
    assert [e["preempted"] for e in saved] == [True], saved  # the ranks saved on the way out
