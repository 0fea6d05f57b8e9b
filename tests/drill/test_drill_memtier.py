"""The drill's memory-tier faults on the demo (issue 25 item 5): real supervisor, real
torchrun agent and worker with the demo's Checkpointer publishing every step
(``--memory-every 1``), a real SIGKILL and a real bit flip in a tmpfs slot."""

from __future__ import annotations

import pytest

from unbroken.elastic.drill.runner import example_config, run_drill

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_memory_tier_faults_recover_bit_identical(tmp_path, drill_steps, token):
    """issue 25 item 5: a SIGKILL restores from the memory tier losing at most K = 1 step;
    a damaged newest slot falls back to the older slot (or disk); each resumed run ends
    bit-identical to the uninterrupted reference (same command, memory tier on)."""
    report = run_drill(
        example_config(
            str(tmp_path / "drill"),
            steps=drill_steps,
            seed=7,  # kill at step 13, damage at 28: both between disk saves (every 5)
            faults=("kill-memory", "memory-damage"),
            extra=("--memory-every", "1"),
            multi_rank=False,
            timeout=300,
        ),
        token=token,
    )
    table = report.format_table()
    print(table)
    assert report.passed, table
    by_kind = {f.injection.spec.kind: f for f in report.faults}
    assert sorted(by_kind) == ["kill-memory", "memory-damage"]
    for f in by_kind.values():
        assert {c.name: c.ok for c in f.checks}["tier"], f.checks
    kill = by_kind["kill-memory"]
    assert kill.injection.facts["tier"] == "memory"
    assert kill.recovery is not None and kill.recovery["tier"] == "memory"
    assert 0 <= kill.recovery["steps_lost"] <= 1  # K = 1, the recovery record's own count
    damage = by_kind["memory-damage"]
    facts = damage.injection.facts
    # the damaged step is never restored from memory: the older slot, or disk when the
    # disk tier holds as much (the seeded step can fall on a disk save)
    assert damage.restored == damage.injection.expected_restore
    if facts["tier"] == "memory":
        assert damage.restored == facts["damaged_step"] - facts["memory_every"]
    else:
        assert damage.restored == facts["disk_step"]
    (single,) = report.runs
    assert single.exact_until is None and single.result["identical"]
