"""`unbroken drill -- SCRIPT` on a user's script: the README's loop, as a user would run it.

The script logs only the loss (no sample ids): the drill must still judge the final state
(the loader's position included) and the loss curve, and say that the data order was not
compared rather than fail for want of ids.
"""

from __future__ import annotations

import json
import os

import pytest

from unbroken.cli import main

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_resumable.py")


def test_drill_on_the_readme_loop_passes_without_sample_ids(tmp_path, capsys) -> None:
    out = str(tmp_path / "drill")
    rc = main(["drill", "--dir", out, "--faults", "kill", "--", EXAMPLE, "{dir}"])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    report = json.load(open(os.path.join(out, "drill.json")))
    assert report["passed"] and [f["spec"]["kind"] for f in report["faults"]] == ["kill"]
    checks = {c["name"]: c for c in report["runs"][0]["checks"]}
    assert checks["final state"]["ok"] and "loader" in checks["final state"]["detail"]
    assert "ids_logged" not in checks["final state"]["detail"]
    assert checks["loss curve"]["ok"]
    # issue 21 item 9: said as not checked (n/c), and the loader's position named
    assert checks["data order"]["detail"].startswith("not checked: no sample ids logged")
    assert checks["data order"]["skipped"] and "loader's position" in checks["data order"]["detail"]
