"""The prepared GPU scripts stay runnable: their CPU smoke runs (CI has no GPU).

``benchmarks/gpu_checks.py --smoke`` also proves, on CPU, what its first check proves on
CUDA: a training restored from a checkpoint into a fresh model ends bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_checks.py")


def test_gpu_checks_smoke_run(tmp_path) -> None:
    out = tmp_path / "gc.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--json", str(out), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["resume"]["identical"] and res["resume"]["restored_step"] == 4
    assert set(res["ckpt"]["stall"]) == {
        "D2H floor (pinned, preallocated)",
        "unbroken Checkpointer(async_save=True).save",
        "dcp.async_save + DefaultStager",  # issue 23: the staged anchor, like for like
        "dcp.async_save",
    }
    assert res["ckpt"]["load"]["unbroken_verified_s"] > 0
    assert res["ckpt"]["load"]["unbroken_verified_cold_s"] > 0  # issue 23: cold load too
    after = res["ckpt"]["after_restore"]  # a resumed job's first save: buffers made ahead
    assert after["first_save_stall_s"] > 0 and after["buffers_ready_s"] >= 0
    ring = res["ring"]  # the pinned-ring check's CPU run: same batches, copies intact
    assert ring["identical"] and ring["copies_intact"] and ring["batches"] == 12
    assert ring["registrations"] == ring["registrations_left_unmapped"] == 0  # no CUDA here
    assert len(ring["step_ms"]) == 4  # with the ring's own pace
    feed = res["feed"]
    assert feed["rc"] == 0 and set(feed["results"]) == {"a", "b", "c", "d"}
    assert feed["pass"] is None  # no verdict on CPU


def test_the_prepare_overlap_script_runs_on_cpu(tmp_path) -> None:
    """``benchmarks/gpu_prepare_overlap.py --smoke``: the loop timed before, during and after
    the checkpoint thread allocates the snapshot buffers (a GPU question; this keeps the
    script from rotting)."""
    out = tmp_path / "o.json"
    script = os.path.join(os.path.dirname(SCRIPT), "gpu_prepare_overlap.py")
    proc = subprocess.run(
        [sys.executable, script, "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["allocated_bytes"] >= res["state_gib"] * 2**30 * 0.99 > 0
    assert set(res["median_step_s"]) == {"before", "during", "after"}
