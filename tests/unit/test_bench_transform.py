"""`unbroken data bench --transform path/to/train.py:fn`: a transform defined in a script."""

from __future__ import annotations

import json
import sys

from unbroken.cli import main
from unbroken.data.diagnose.bench import resolve_transform

SCRIPT = """
import sys

import numpy as np


def decode(sample):
    return np.frombuffer(sample["bin"], dtype=np.uint8).astype(np.float32).sum()


if __name__ == "__main__":
    sys.exit("the training script's main block must not run")
"""


def test_bench_times_a_transform_from_a_training_script(tmp_path, stream_data, capsys):
    script = tmp_path / "my_train_bench_script.py"
    script.write_text(SCRIPT)
    try:
        fn = resolve_transform(f"{script}:decode")
        assert fn is not None and fn({"bin": b"\x01\x02"}) == 3.0
        rc = main(
            [
                "data",
                "bench",
                stream_data("tar"),
                "--transform",
                f"{script}:decode",
                "--batch-size",
                "8",
                "--num-workers",
                "1",
                "--batches",
                "4",
                "--max-seconds",
                "10",
                "--json",
            ]
        )
        out = capsys.readouterr().out
        assert rc == 0, out
        report = json.loads(out.splitlines()[0])
        decode = next(s for s in report["stages"] if s["name"] == "decode")
        assert decode["note"] == "decode" and decode["samples_per_s"] > 0
    finally:
        sys.modules.pop("my_train_bench_script", None)


def test_bad_script_transforms_name_the_problem(tmp_path, stream_data, capsys):
    data = stream_data("tar")
    assert main(["data", "bench", data, "--transform", f"{tmp_path}/nope.py:fn"]) == 2
    assert "no file" in capsys.readouterr().err
    broken = tmp_path / "broken_bench_script.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    assert main(["data", "bench", data, "--transform", f"{broken}:fn"]) == 2
    assert "boom at import" in capsys.readouterr().err
    assert "broken_bench_script" not in sys.modules
    ok = tmp_path / "ok_bench_script.py"
    ok.write_text("x = 1\n")
    try:
        assert main(["data", "bench", data, "--transform", f"{ok}:fn"]) == 2
        assert "has no attribute 'fn'" in capsys.readouterr().err
        assert main(["data", "bench", data, "--transform", f"{ok}:x"]) == 2
        assert "is not callable" in capsys.readouterr().err
    finally:
        sys.modules.pop("ok_bench_script", None)
