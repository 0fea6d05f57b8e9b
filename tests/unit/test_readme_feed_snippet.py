"""README's "Feed the GPU and find the stall" snippet, run as written on a CPU, leaves what
`unbroken data report RUN` reads (a short run too: the timeline is written every 1,000
steps and when the timer is closed)."""

from __future__ import annotations

import os
import re

import pytest

from unbroken import MetricLog
from unbroken.cli import main
from unbroken.data import StatefulLoader, StreamingDataset

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _snippet() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("### Feed the GPU and find the stall\n", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m is not None
    return m.group(1)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_the_feed_snippet_leaves_a_timeline_for_data_report(tmp_path, stream_data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    steps: list[object] = []

    class State:
        step = 0

    scope = {
        "loader": StatefulLoader(StreamingDataset(stream_data("tar"), seed=0), batch_size=8),
        "metrics": MetricLog(str(tmp_path / "metrics.jsonl")),
        "state": State(),
        "normalise_on_gpu": lambda b: b,
        "train_step": steps.append,
    }
    exec(compile(_snippet(), "README.md", "exec"), scope)
    assert steps, "the snippet trained no step"
    assert main(["data", "report", "run", "--no-plot"]) == 0
