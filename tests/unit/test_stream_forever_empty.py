"""``loader.forever()`` over epochs that give this rank no batch at all: ``last_batch="drop"``
with an epoch shorter than the global batch, or ``"short"`` on a rank whose share of the
only step is empty. Each epoch yields nothing, so ``next()`` used to spin through epochs
forever (CPU at 100%, the epoch counter climbing, no error); it must raise at once, naming
the options and the fix. Run in a subprocess with a deadline: the failure mode is a hang."""

from __future__ import annotations

import subprocess
import sys

import pytest

from datakit import build_tar_dataset

CODE = """
import sys
from unbroken.data import StatefulLoader, StreamingDataset
root, policy, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ds = StreamingDataset(root, seed=1, rank=rank, world_size=world)
loader = StatefulLoader(ds, batch_size=4, collate_fn=list, last_batch=policy)
assert len(loader) == 0
try:
    next(loader.forever())
except ValueError as e:
    print("ERROR", e)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tar_dataset(str(tmp_path_factory.mktemp("tiny") / "d"), 3)


@pytest.mark.parametrize("policy,rank,world", [("drop", 0, 1), ("drop", 1, 2), ("short", 3, 4)])
def test_forever_over_epochs_without_a_batch_raises_instead_of_spinning(
    tiny, policy, rank, world
) -> None:
    try:
        out = subprocess.run(
            [sys.executable, "-c", CODE, tiny, policy, str(rank), str(world)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"next(loader.forever()) hung with last_batch={policy!r}, rank {rank}/{world}")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("ERROR"), (out.stdout, out.stderr)
    assert f"last_batch='{policy}'" in line and "batch_size=4" in line and "3 samples" in line
