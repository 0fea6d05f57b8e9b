"""C-IDENTICAL: N straight steps == k steps, SIGKILL, resume, finish — bit for bit.

Runs the demo training script (dropout, shuffled data, AdamW, cosine LR, EMA, gradient
accumulation 2, metric log) as real processes; the crash is a real SIGKILL.
"""

from __future__ import annotations

import os

import pytest

from ckptkit import assert_same_run, demo_run
from unbroken.ckpt.compare import compare_runs
from unbroken.demo import run_training

STEPS = 60
COMMON = ["--ckpt-every", "10", "--batch", "8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    return demo_run(str(tmp_path_factory.mktemp("reference")), STEPS, COMMON)


@pytest.mark.parametrize(
    "die_at",
    [
        "27:1",  # inside an accumulation cycle (second micro-batch of step 27)
        "41:0",  # right after the save at step 40
        "11:1",  # one step after the first save, mid-cycle
        "58:0",  # near the end, long after the last save
    ],
)
def test_sigkill_and_resume_is_bit_identical(reference: str, tmp_path, die_at: str) -> None:
    d = str(tmp_path)
    rc, _ = run_training(d, STEPS, 0, [*COMMON, "--die-at", die_at])
    assert rc == -9, "the run must have died of SIGKILL"
    rc, _ = run_training(d, STEPS, 0, COMMON)
    assert rc == 0, open(os.path.join(d, "train.log")).read()
    assert_same_run(reference, d)


def test_broken_resume_is_detected(reference: str, tmp_path) -> None:
    """The comparison is not vacuous: forgetting the RNG on restore shows up at once."""
    d = str(tmp_path)
    assert run_training(d, STEPS, 0, [*COMMON, "--die-at", "25:0"])[0] == -9
    assert run_training(d, STEPS, 0, [*COMMON, "--break", "rng"])[0] == 0
    res = compare_runs(reference, d)
    assert not res["identical"] and res["first_loss_diff"] == 21 and res["model"]
