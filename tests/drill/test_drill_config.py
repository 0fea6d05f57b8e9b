"""`unbroken drill` without running a job: the seeded plan, option errors that say what to
fix, the divergence diagnosis, and a drill directory that is not ours."""

from __future__ import annotations

import pytest

from unbroken import cli
from unbroken.elastic.drill.judge import diagnose, unplanned_failures
from unbroken.elastic.drill.plan import ELASTIC_KINDS, FAULT_KINDS, SINGLE_KINDS, plan_faults
from unbroken.elastic.drill.runner import DrillConfig, example_config, run_drill


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


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"no \{dir\}.*train.py --out \{dir\}"):
        DrillConfig(("train.py", "--out", "x"))
    with pytest.raises(ValueError, match=r"unknown fault kind\(s\) \['boom'\]; choose from kill"):
        DrillConfig(("train.py", "{dir}"), faults=("kill", "boom"))
    with pytest.raises(ValueError, match=r"\['world-size'\].*pass --multi-rank"):
        DrillConfig(("train.py", "{dir}"), faults=("world-size",))
    with pytest.raises(ValueError, match="no training command"):
        DrillConfig(())
    assert DrillConfig(("t.py", "{dir}")).kinds == SINGLE_KINDS
    assert DrillConfig(("t.py", "{dir}"), multi_rank=True).kinds == FAULT_KINDS
    assert example_config("d", faults=("hang", "kill")).kinds == ("kill", "hang")


def test_cli_usage_errors_exit_2(capsys):
    assert cli.main(["drill", "--", "train.py", "--steps", "3"]) == 2
    assert "has no {dir}" in capsys.readouterr().err
    assert cli.main(["drill", "--faults", "kill,nope", "--", "train.py", "{dir}"]) == 2
    assert "unknown fault kind(s) ['nope']" in capsys.readouterr().err


def test_refuses_a_directory_that_is_not_a_drill(tmp_path):
    (tmp_path / "precious.txt").write_text("user data")
    with pytest.raises(ValueError, match="not a drill directory"):
        run_drill(DrillConfig(("t.py", "{dir}"), str(tmp_path)))
    assert (tmp_path / "precious.txt").read_text() == "user data"


@pytest.mark.parametrize(
    ("res", "restored", "words"),
    [
        (
            {"first_sample_diff": 320, "first_sample_step": 21, "first_sample_ids": (7, 9)},
            20,
            [
                "data position was not restored",
                "sample #320 (step 21)",
                "id 9 where the reference had 7",
            ],
        ),
        ({"first_sample_diff": None, "first_loss_diff": 21}, 20, ["forward pass", "RNG"]),
        ({"first_sample_diff": None, "first_loss_diff": 22}, 20, ["optimizer update", "step 22"]),
        ({"first_sample_diff": None, "first_loss_diff": 23}, 20, ["learning-rate schedule"]),
        (
            {"first_sample_diff": None, "first_loss_diff": 18},
            20,
            ["metric log was not rolled back"],
        ),
    ],
)
def test_diagnosis_from_where_the_runs_part(res, restored, words):
    text = diagnose(res, restored)
    for w in words:
        assert w in text, text


def test_failures_no_injection_explains_fail_the_drill():
    def fail(t: float, step: int) -> dict:
        return {"t": t, "step": step, "fault": "process", "rule": "hang", "reason": "stalled"}

    ok = unplanned_failures(
        [10.0, 20.0], [("A", fail(10.5, 7)), ("B", fail(10.6, 7)), ("A", fail(21.0, 15))]
    )
    assert ok.ok and "3 recorded" in ok.detail
    bad = unplanned_failures(
        [10.0, 20.0], [("A", fail(5.0, 3)), ("A", fail(10.5, 7)), ("A", fail(12.0, 9))]
    )
    assert not bad.ok
    assert "2 failure(s) no injected fault explains" in bad.detail
    assert "node A at step 3: process/hang" in bad.detail and "step 9" in bad.detail
