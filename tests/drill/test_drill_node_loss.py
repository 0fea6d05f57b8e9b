"""The drill's ``node-loss`` fault on the demo (issue 25 item 5, the node loss): two real
``unbroken run`` supervisors on 127.0.0.1 as the two nodes of a ``--nnodes 2`` job (one rank
each) with the memory tier on (``--memory-every 1``); node B is lost whole (its supervisor,
agent and worker SIGKILLed, its node-local memory directory removed), a replacement node C
joins, and the judge requires the restore to come from the peer replica node A kept, at most
K steps lost, and the run to end bit-identical to an uninterrupted world-2 reference.

One drill run is shared by the assertions (a module fixture); the judge's negative verdicts
(a restore from disk, a fresh start) are checked on recorded events, without a run."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from unbroken.common import events, memdir
from unbroken.common.procs import kill_matching
from unbroken.elastic.drill.inject import _removable
from unbroken.elastic.drill.judge import evaluate_fault
from unbroken.elastic.drill.plan import FaultSpec, Injection
from unbroken.elastic.drill.report import DrillReport
from unbroken.elastic.drill.runner import ENV_TOKEN, example_config, run_drill

STEPS = 20  # the fewest the plan allows with a disk save every 5: fault at step 11 or 12


def _drill(out: str, token: str, **kwargs: Any) -> tuple[DrillReport, float]:
    t0 = time.monotonic()
    report = run_drill(
        example_config(
            out,
            steps=STEPS,
            seed=0,
            faults=("node-loss",),
            extra=("--memory-every", "1"),
            timeout=300,
            **kwargs,
        ),
        token=token,
    )
    print(report.format_table())
    return report, time.monotonic() - t0


@pytest.fixture(scope="module")
def node_loss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DrillReport, float]]:
    """One drill of the node-loss fault on the demo: (report, wall seconds)."""
    token = uuid.uuid4().hex
    try:
        yield _drill(str(tmp_path_factory.mktemp("node-loss") / "drill"), token)
    finally:
        kill_matching(ENV_TOKEN, token, timeout=10.0)


def _checks(fault: Any) -> dict[str, Any]:
    return {c.name: c for c in fault.checks}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_node_loss_restores_from_the_peer_replica(node_loss):
    """issue 25 item 5 (node loss): the row PASSes, the recovery record's tier is the peer
    replica, steps lost <= K = 1, the restored step is the replica node A held."""
    report, wall = node_loss
    print(f"node-loss drill: {wall:.1f} s")
    (f,) = report.faults
    assert f.injection.spec.kind == "node-loss" and f.injection.spec.run == "nodes"
    assert report.passed, report.format_table()
    assert f.verdict == "PASS"
    assert f.failure is not None and f.failure["fault"] == "node_lost"
    rec = f.recovery
    assert rec is not None and rec["tier"] == "peer replica", rec
    assert 0 <= rec["steps_lost"] <= 1, rec  # K = 1
    facts = f.injection.facts
    assert facts["tier"] == "peer replica" and facts["replica_step"] is not None
    assert f.restored == f.injection.expected_restore == facts["replica_step"]
    assert _checks(f)["tier"].ok and "peer replica" in _checks(f)["tier"].detail


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_node_loss_kills_the_node_whole_and_a_replacement_joins(node_loss):
    """The lost node (the one not hosting the rendezvous store: A or B, whichever bound it
    second) has its memory directory gone (a node's /dev/shm goes with it) and its
    supervisor never ends by itself; the replacement node C finishes the job with the
    survivor."""
    report, _ = node_loss
    (f,) = report.faults
    facts = f.injection.facts
    lost, kept = facts["lost_node"], facts["report_node"]
    assert {lost, kept} == {"A", "B"} and facts["replacement"] == "C", facts
    assert facts["memory_removed"] and not os.path.exists(facts["memory_removed"])
    want = {f"nodes/{lost}": None, f"nodes/{kept}": 0, "nodes/C": 0}
    assert report.exits == want, report.exits
    # the replacement's rank restored from the peer replica too (the tier check counts it)
    joined = events.load_events(os.path.join(report.drill_dir, "nodes", "node-C"))
    loaded = [e for e in joined if e["event"] == "loaded"]
    assert [(e["tier"], e["step"]) for e in loaded] == [("peer replica", f.restored)], loaded
    assert "peer replica tier on 2 ranks" in _checks(f)["tier"].detail


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_node_loss_run_is_bit_identical_to_the_world2_reference(node_loss):
    """The resumed run against the uninterrupted ``torchrun --standalone`` world-2 run:
    final state, loss curve and sample order, floats compared bit for bit."""
    report, _ = node_loss
    (run,) = report.runs
    assert run.run == "nodes" and run.world_reference == 2
    assert run.exact_until is None and run.passed, [c.detail for c in run.checks]
    assert run.result["identical"], run.result


def _judge_node_loss(replica_steps, loaded):
    """The node-loss judge's ``tier`` check on a recorded failure at step 12 (node B lost,
    A kept own slots [12, 11], disk step 10) and the given restores."""
    inj = Injection(FaultSpec(1, "node-loss", "nodes", 12), t=100.0, step=12)
    usable = sorted(set(replica_steps or ()) & {12, 11}, reverse=True)
    inj.facts.update(
        report_node="A",
        lost_node="B",
        replacement="C",
        memory_steps=[12, 11],
        replica_steps=replica_steps,
        replica_step=usable[0] if usable else None,
        memory_every=1,
        disk_step=10,
        tier="peer replica",
    )
    if usable:
        inj.expected_restore = usable[0]
    else:
        inj.min_restore = 10
    fail = {"t": 101.0, "t_fail": 100.5, "t_detect": 101.0, "event": "failure"}
    fail.update(attempt=0, kind="exit", fault="node_lost", step=12, action="wait_for_nodes")
    ev = [fail, {"t": 102.0, "event": "launch", "attempt": 1}]
    ev.append({"t": 103.0, "event": "workers_up", "attempt": 1})
    joined: list[dict[str, Any]] = [{"t": 103.0, "event": "start"}]
    for where, (tier, step) in zip((ev, joined)[: len(loaded)], loaded, strict=True):
        where.append({"t": 104.0, "event": "loaded", "attempt": 1, "tier": tier, "step": step})
    res = evaluate_fault(inj, ev, "", [], joined=joined)
    return res, {c.name: c for c in res.checks}["tier"]


def test_node_loss_restored_from_disk_fails_naming_the_disk_tier():
    """issue 25 item 5 (negative), the judge: with no replica kept (the replica off:
    ``memory_replica=False`` or ``$UNBROKEN_MEMORY_JUMP`` a multiple of the world size) both
    ranks restore disk step 10; the row FAILs, saying the restore came from the disk tier
    and that node A held no replica of the lost rank. The same restores from the peer
    replica at A's newest common step pass (the check can go either way)."""
    res, tier = _judge_node_loss(None, [("disk", 10), ("disk", 10)])
    assert not tier.ok and res.verdict == "FAIL"
    assert "from the disk tier" in tier.detail and "expected peer replica" in tier.detail
    assert "held no replica" in tier.detail and "replica is off" in tier.detail, tier.detail
    res, tier = _judge_node_loss([12, 11], [("peer replica", 12), ("peer replica", 12)])
    assert tier.ok, tier.detail
    assert "restored step 12 from the peer replica tier on 2 ranks" in tier.detail


def test_only_a_memory_directory_unbroken_run_made_is_removed(tmp_path):
    """issue 25 item 5 (node loss), shared node: the lost node's memory directory (read
    from its supervisor's start event) is removed only when it is a real directory of this
    user right under /dev/shm/unbroken-<uid>/; a path elsewhere, one that climbs out with
    '..', or a symlink planted in its place is refused before anything is killed."""
    root = memdir.user_root()
    for bad in (str(tmp_path), os.path.join(root, "..", "elsewhere"), "/dev/shm"):
        with pytest.raises(RuntimeError, match="not under .*nothing is removed"):
            _removable(bad)
    memdir.create(root)
    link = os.path.join(root, f"drill-test-{uuid.uuid4().hex}")
    os.symlink(str(tmp_path), link)
    try:
        with pytest.raises(RuntimeError, match="a symlink or another user's"):
            _removable(link)
    finally:
        os.unlink(link)
    real = memdir.create(os.path.join(root, f"drill-test-{uuid.uuid4().hex}"))
    try:
        assert _removable(real) == real
    finally:
        memdir.remove(real)


def test_a_fresh_start_after_a_node_loss_fails_naming_why():
    """issue 25 item 5 (node loss), the judge: a replacement that started from scratch
    (no restore recorded) fails the tier row, which says what the survivor held and why
    its replica was no use (one at no step of its own slots)."""
    res, tier = _judge_node_loss([10], [])
    assert not tier.ok and res.verdict == "FAIL"
    assert "no restore recorded (a fresh start)" in tier.detail, tier.detail
    assert "node A kept replica(s) of step(s) [10], own slots [12, 11]" in tier.detail
    assert "held no replica of node B's rank at a step of its own slots" in tier.detail
