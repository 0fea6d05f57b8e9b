"""The memory tier against a real SIGKILL (issue 25: "Steps lost to a SIGKILL of a worker
<= K"; C-IDENTICAL, C-TIERS).

The demo training script (dropout, shuffled data, AdamW, cosine LR, EMA, gradient
accumulation 2, metric log) runs as a real process with ``--memory-every 1 --ckpt-every
5``, SIGKILLs itself mid-step, and is started again: it must resume from the memory tier
(its slots on /dev/shm outlived the process), lose at most one completed step, and end
bit-identical to an uninterrupted run. With both slots damaged it falls back to the disk
tier and says why, still bit-identical.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from ckptkit import assert_same_run, demo_run, flip
from unbroken.ckpt.memtier import default_dir
from unbroken.demo import run_training

STEPS = 24
COMMON = ["--ckpt-every", "5", "--memory-every", "1", "--batch", "8"]
DIE_AT = "18:1"  # second micro-batch of step 18: 17 steps done, the disk tier holds 15
_RESTORED = re.compile(
    r"resumed from step (\d+), saved at .*?, in [\d.]+ s, from the (\w+) tier(.*)"
)


@pytest.fixture(autouse=True)
def _own_slots(monkeypatch) -> None:
    # the default place (/dev/shm/unbroken-<uid>/<hash of the root>), never a shared one
    monkeypatch.delenv("UNBROKEN_MEMORY_TIER", raising=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    return demo_run(str(tmp_path_factory.mktemp("reference")), STEPS, COMMON)


def _restored(run_dir: str) -> list[tuple[int, str, str]]:
    text = open(os.path.join(run_dir, "train.log")).read()
    return [(int(s), tier, rest) for s, tier, rest in _RESTORED.findall(text)]


def _killed_run(tmp_path) -> tuple[str, str]:
    d = str(tmp_path / "run")
    slots = default_dir(os.path.join(d, "ckpt"))
    shutil.rmtree(slots, ignore_errors=True)
    rc, _ = run_training(d, STEPS, 0, [*COMMON, "--die-at", DIE_AT])
    assert rc == -9, "the run must have died of SIGKILL"
    assert os.path.isdir(os.path.join(slots, "rank-0")), "the slots must outlive the process"
    return d, slots


def test_sigkill_resumes_from_memory_losing_at_most_one_step(reference: str, tmp_path) -> None:
    """issue 25 goal: K = 1, N = 5, SIGKILL in step 18: the resume loses <= 1 completed
    step (against 2 from the disk tier's step 15), says so in one line, and the run ends
    bit-identical to the uninterrupted one; its slots are gone after the clean end."""
    d, slots = _killed_run(tmp_path)
    rc, _ = run_training(d, STEPS, 0, COMMON)
    assert rc == 0, open(os.path.join(d, "train.log")).read()
    ((step, tier, rest),) = _restored(d)
    done = int(DIE_AT.split(":")[0]) - 1
    assert tier == "memory", rest
    assert done - step <= 1, f"lost {done - step} steps (restored {step}, {done} were done)"
    assert_same_run(reference, d)
    assert not os.path.exists(slots), "a clean end with the disk tier current removes the slots"


def test_damaged_slots_fall_back_to_disk_bit_identical(reference: str, tmp_path) -> None:
    """issue 25: both slots bit-flipped after the SIGKILL: the disk tier's step 15 is
    restored, the one line names the checksum failure, and the end is still identical."""
    d, slots = _killed_run(tmp_path)
    for name in ("slot-0", "slot-1"):
        p = os.path.join(slots, "rank-0", name)
        flip(p, os.path.getsize(p) - 100)
    rc, _ = run_training(d, STEPS, 0, COMMON)
    assert rc == 0, open(os.path.join(d, "train.log")).read()
    ((step, tier, rest),) = _restored(d)
    assert (step, tier) == (15, "disk"), rest
    assert "memory tier not used" in rest and "checksum" in rest, rest
    assert_same_run(reference, d)
