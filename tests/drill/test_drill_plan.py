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
