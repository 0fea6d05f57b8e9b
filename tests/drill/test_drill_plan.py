"""The drill's seeded plan (unbroken.elastic.drill.plan): a pure function of the seed."""

from __future__ import annotations

import pytest

from unbroken.elastic.drill.plan import ELASTIC_KINDS, FAULT_KINDS, SINGLE_KINDS, plan_faults


def test_plan_is_a_pure_function_of_the_seed():
    a = plan_faults(FAULT_KINDS, 50, 5, seed=7)
    assert a == plan_faults(FAULT_KINDS, 50, 5, seed=7)
    assert a != plan_faults(FAULT_KINDS, 50, 5, seed=8)
    assert sorted(p.kind for p in a) == sorted(FAULT_KINDS)
    assert [p.index for p in a] == list(range(1, 8))
    for run, kinds in (("single", SINGLE_KINDS), ("elastic", ELASTIC_KINDS)):
        mine = [p for p in a if p.run == run]
        assert {p.kind for p in mine} == set(kinds)
        steps = [p.step for p in mine]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        # two checkpoints exist before each fault, and a save still follows it
        assert all(2 * 5 + 1 <= s <= 50 - 5 - 1 for s in steps), steps
    assert [p.kind for p in a if p.run == "elastic"] == ["agent-loss", "world-size"]
    corrupt = next(p for p in a if p.kind == "corrupt")
    assert corrupt.mode in ("bitflip", "truncate")
    orders = {tuple(p.kind for p in plan_faults(SINGLE_KINDS, 50, 5, s)) for s in range(20)}
    assert len(orders) > 5, "the one-node order should vary with the seed"


def test_plan_refuses_too_few_steps():
    with pytest.raises(ValueError, match="too few for 5 fault.*at least 26 steps"):
        plan_faults(SINGLE_KINDS, 20, 5, seed=0)


def test_node_loss_gets_a_fixed_world_run_of_its_own():
    """issue 25 item 5 (node loss): node-loss runs in the ``nodes`` run (two nodes at a
    fixed world size, the lost one replaced), never mixed with the one-node memory faults
    or the elastic run whose world shrinks; it needs a script that trains on 2 ranks."""
    from unbroken.elastic.drill.runner import DrillConfig

    kinds = ("kill-memory", "world-size", "node-loss")
    plan = plan_faults(kinds, 50, 5, seed=3)
    assert {p.kind: p.run for p in plan} == {
        "kill-memory": "single",
        "world-size": "elastic",
        "node-loss": "nodes",
    }
    (nl,) = [p for p in plan if p.run == "nodes"]
    assert 2 * 5 + 1 <= nl.step <= 50 - 5 - 1
    with pytest.raises(ValueError, match=r"\['node-loss'\].*pass --multi-rank"):
        DrillConfig(("t.py", "{dir}"), faults=("node-loss",))
    cfg = DrillConfig(("t.py", "{dir}"), faults=("node-loss",), multi_rank=True)
    assert cfg.kinds == ("node-loss",)
