"""What a failure's text may do to the records and the terminal: an exception's message is
the job's text (control characters, several lines, any length), and ``events.jsonl`` is a
file `unbroken report` reads like any other (``unbroken.common.text``: untrusted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from unbroken.common import events
from unbroken.elastic import faults

pytestmark = pytest.mark.timeout(60)

_HOSTILE = "first line\nsecond \x1b[2J\x1b[31mred\x1b[0m\x07 \u202eline"


def _failure(message: str = "", traceback: str = "", stderr: str = "") -> faults.Evidence:
    f = faults.WorkerFailure(0, 0, 1, 4242, message, traceback, stderr)
    return faults.Evidence("exit", 1, (f,), "", 7)


def test_a_reason_and_signature_are_one_printable_line_of_bounded_length():
    c = faults.classify(_failure(message=f"ValueError: {_HOSTILE}" + "x" * 100_000))
    assert c.rule == "exception" and "ValueError: first line" in c.reason, c
    for text in (c.reason, c.signature or ""):
        assert text.isprintable() and len(text) <= 1000, text[:200]


def test_an_error_file_the_launcher_hands_over_is_read_whole(tmp_path):
    """torch's ``@record`` file holds the message twice (message and call stack): a 1.5 MB
    message (a 3 MB file, under the launcher's 4 MiB) was unreadable past the 1 MiB limit,
    and the failure an "unknown exit 1". A bigger file the launcher shortens (its test:
    tests/integration/test_supervisor_faults_exit.py)."""
    log_dir = tmp_path / "torchelastic"
    err = log_dir / "none_x" / "attempt_0" / "0" / "error.json"
    err.parent.mkdir(parents=True)
    msg = "ValueError: boom " + "x" * (3 << 19)
    err.write_text(
        json.dumps({"message": {"message": msg, "extraInfo": {"py_callstack": msg}}}),
    )
    x = faults.WorkerExit(0, 0, 1, False, 4242, 4241, 1.0, "zygote")
    (f,) = faults.collect_worker_failures("", str(log_dir), [x])
    assert f.message.startswith("ValueError: boom xxx"), f.message[:100]
    c = faults.classify(faults.Evidence("exit", 1, (f,), "", 4))
    assert c.rule == "exception" and "ValueError: boom" in c.reason, c.reason[:200]


def test_report_prints_a_hostile_reason_escaped_on_one_line(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run, mode=0o700)
    for rec in (
        {"t": 1.0, "event": "start"},
        {"t": 1.1, "event": "launch", "attempt": 0},
        {"t": 5.0, "event": "failure", "attempt": 0, "t_fail": 4.0, "t_detect": 4.5,
         "fault": "process\x1b[2J", "reason": _HOSTILE, "step": 3},
        {"t": 9.0, "event": "finish", "exit_code": 0},
    ):  # fmt: skip
        events.append_event(run, rec)
    out = subprocess.run(
        [sys.executable, "-m", "unbroken", "report", run, "--no-plot"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out, out
    (row,) = [ln for ln in out.splitlines() if ln.split()[:2] == ["0", "0"]]
    assert "first line" in row and "\\x1b" in row, out
    assert len(out.splitlines()) == 4, out  # title, header, the row, the totals: no more lines
