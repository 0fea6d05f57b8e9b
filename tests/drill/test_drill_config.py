"""`unbroken drill` without running a job: option errors that say what to fix, and a drill
directory that is not ours."""

from __future__ import annotations

import pytest

from unbroken import cli
from unbroken.elastic.drill.plan import FAULT_KINDS, SINGLE_KINDS
from unbroken.elastic.drill.runner import DrillConfig, example_config, run_drill


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
