"""A worker that ends with an exit code of its own (``sys.exit(3)``: no exception, no
traceback, no error file) under `unbroken run`: real torchrun on 127.0.0.1, a real worker.

The code is all the evidence there is, so it must be what the failure record, the summary
and the stop report say: not torchrun's status, which a kept agent does not have yet.
"""

from __future__ import annotations

import os

import elastic_harness as h
import pytest

from unbroken.elastic import faults

pytestmark = pytest.mark.timeout(240)

_EXIT_AT_STEP_4 = """\
import sys, time
from unbroken.elastic import beat
for step in range(1, 5):
    beat(step)
    time.sleep(0.05)
sys.exit(3)
"""


def test_a_worker_exiting_3_at_the_same_step_twice_is_named_by_its_code(tmp_path):
    """Before: every record said "exit code None" (the agent, kept for the restart, had no
    status) and the stop report's last failure was blank."""
    script = tmp_path / "exit3.py"
    script.write_text(_EXIT_AT_STEP_4)
    with h.jobs() as start:
        job = start(str(tmp_path / "run"), ["--max-restarts", "5"], [], script=str(script))
        assert job.wait(90) == faults.EXIT_DETERMINISTIC, job.output()[-3000:]

    first, second = job.events("failure")
    assert (first["rule"], first["action"], first["step"]) == ("unknown", "restart", 4), first
    assert (second["fault"], second["action"], second["step"]) == ("deterministic", "stop", 4)
    assert first["signature"] == second["signature"] == "exit 3", (first, second)
    assert "rank 0" in first["reason"] and "exit code 3" in first["reason"], first
    assert "None" not in first["reason"], first
    report = open(os.path.join(job.run_dir, "stop-report.txt")).read()
    assert "attempt 0: step 4: [process/unknown]" in report, report
    assert "None" not in report, report
    last = report.split("last failure, rank 0 (attempt 1):\n", 1)[1].splitlines()[0]
    assert "exit code 3" in last, report


_RAISE_10_MB = """\
import time
from torch.distributed.elastic.multiprocessing.errors import record
from unbroken.elastic import beat

@record
def main():
    for step in range(1, 5):
        beat(step)
        time.sleep(0.05)
    raise ValueError("boom " + "x" * (10 << 20))

main()
"""


def test_an_exception_with_a_10_mb_message_is_still_named(tmp_path):
    """torch's ``@record`` file holds the message twice (20 MB): the launcher dropped it as
    "not a whole JSON object" and the failure became "unknown: exit code 1" (signature
    "exit 1"). Now the launcher hands torchrun a whole file with the message's start."""
    script = tmp_path / "raise.py"
    script.write_text(_RAISE_10_MB)
    with h.jobs() as start:
        job = start(str(tmp_path / "run"), [], [], script=str(script))
        assert job.wait(120) == faults.EXIT_DETERMINISTIC, job.output()[-3000:]

    first, second = job.events("failure")
    assert first["rule"] == "exception" and "ValueError: boom xxx" in first["reason"], first
    assert first["signature"].startswith("ValueError: boom xxx"), first["signature"][:100]
    assert len(first["signature"]) < 1000 and second["signature"] == first["signature"]
    assert "not a whole JSON object" not in job.output()
