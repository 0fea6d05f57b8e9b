"""The README's loop (``examples/train_resumable.py``) survives a real SIGKILL.

Packed shards, a StatefulLoader with 2 worker processes, the DevicePrefetcher (pass-through
on CPU), async checkpoints: a run killed mid-way and started again with the same command
ends bit-identical to an uninterrupted run, with the same loss at every step.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from unbroken.ckpt import read_checkpoint
from unbroken.common.metrics import read_metrics
from unbroken.demo import run_until

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_resumable.py")


def _run(run_dir: str, kill_at: int | None = None) -> int:
    return run_until([sys.executable, EXAMPLE, run_dir], run_dir, kill_at=kill_at, timeout=300)[0]


def _flat(obj: object, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}/{key}").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, val in enumerate(obj) for k, v in _flat(val, f"{prefix}/{i}").items()}
    return {prefix: obj}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_readme_loop_killed_and_rerun_ends_bit_identical(tmp_path) -> None:
    ref, run = str(tmp_path / "ref"), str(tmp_path / "run")
    assert _run(ref) == 0
    assert _run(run, kill_at=170) == -signal.SIGKILL
    assert max(r["step"] for r in read_metrics(os.path.join(run, "metrics.jsonl"))) < 300
    assert _run(run) == 0

    a, b = read_checkpoint(os.path.join(ref, "ckpt")), read_checkpoint(os.path.join(run, "ckpt"))
    assert a["counters"] == b["counters"] and a["counters"]["step"] == 300
    for part in ("model", "optimizer", "scheduler", "loader"):
        fa, fb = _flat(a["components"][part]), _flat(b["components"][part])
        assert fa.keys() == fb.keys(), part
        differ = [k for k in fa if not _same(fa[k], fb[k])]
        assert not differ, f"{part} differs after resume: {differ[:3]}"
    la = [(r["step"], r["loss"]) for r in read_metrics(os.path.join(ref, "metrics.jsonl"))]
    lb = [(r["step"], r["loss"]) for r in read_metrics(os.path.join(run, "metrics.jsonl"))]
    assert la == lb  # every step once, the same loss (the log dropped the killed tail)
