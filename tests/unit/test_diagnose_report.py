"""`unbroken data bench` / `data report` end to end: files, text, a PNG that exists."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

from unbroken.cli import main
from unbroken.data.diagnose.timer import StepTimer

pytest.importorskip("matplotlib")


def write_sawtooth_run(run: str, steps: int = 240, workers: int = 4) -> None:
    """A timeline through the real StepTimer file path (values injected via record)."""
    rng = np.random.default_rng(0)
    timer = StepTimer(run_dir=run, batch_size=32, num_workers=workers, window=64, log_every=0)
    for i in range(steps):
        wait = 30.0 if i % workers == 0 else 0.1
        timer._record(int((wait + rng.uniform(0, 0.1)) * 1e6), int(rng.normal(8.0, 0.2) * 1e6))
    timer.close()


@pytest.mark.slow  # issue 24 item 10: out of `make unit`, still in `make test`
def test_bench_then_report_writes_json_png_and_names_things(
    stream_data: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(tmp_path / "run")
    write_sawtooth_run(run)
    rc = main(
        [
            "data",
            "bench",
            stream_data("tar"),
            "--batch-size",
            "8",
            "--num-workers",
            "1",
            "--timeline",
            run,
            "--batches",
            "8",
            "--max-seconds",
            "5",
            "--out",
            run,
            "--metrics",
            os.path.join(run, "metrics.jsonl"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "bottleneck:" in out and "suggest: num_workers=" in out
    bench = json.load(open(os.path.join(run, "data_bench.json")))
    # consumer rate from the timeline: 32 samples per ~8 ms of compute
    assert bench["consume_rate"] == pytest.approx(4000, rel=0.05)
    assert [s["name"] for s in bench["stages"]][:3] == ["shard read", "decode", "collate"]
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert metrics[0]["bench/consume_samples_per_s"] == pytest.approx(4000, rel=0.05)

    rc = main(["data", "report", run])
    out = capsys.readouterr().out
    assert rc == 0
    assert "stall" in out and "sawtooth: a cycle of 4 steps" in out
    assert "matches num_workers=4" in out  # from the timeline header
    assert "bottleneck:" in out
    png = os.path.join(run, "data_report.png")
    assert out.strip().endswith(f"wrote {png}")
    with open(png, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20_000


def test_report_text_only_and_flat_timeline(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(tmp_path / "flat")
    timer = StepTimer(run_dir=run, window=32, log_every=0)
    for _ in range(100):
        timer._record(50_000, 10_000_000)
    timer.close()
    other = str(tmp_path / "elsewhere.png")
    assert main(["data", "report", run, "--no-plot", "--out", other]) == 0
    out = capsys.readouterr().out
    assert "no sawtooth; stall below 5%" in out and "wrote" not in out
    assert not os.path.exists(other)
    assert main(["data", "report", run, "--out", other]) == 0
    assert os.path.exists(other)


def test_report_on_an_empty_dir_and_bench_with_both_rates_fail_clearly(
    tmp_path: Any, stream_data: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["data", "report", str(tmp_path)]) == 2
    assert "holds neither data_steps.csv" in capsys.readouterr().err
    assert (
        main(
            [
                "data",
                "bench",
                stream_data("tar"),
                "--consume-rate",
                "5",
                "--timeline",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "not both" in capsys.readouterr().err
    assert main(["data", "bench", stream_data("tar"), "--transform", "nope"]) == 2
    assert "package.module:function" in capsys.readouterr().err
