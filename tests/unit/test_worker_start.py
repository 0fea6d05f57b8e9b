"""A DataLoader worker starts from what the training process already imported.

Every run that starts workers (a resume, each epoch without persistent workers) forks them
from the training process; a module a worker imports after its fork is imported again in
every worker of every start. torch's worker loop seeds ``numpy.random`` in each worker, and
numpy 2 imports it lazily: ~10 ms per worker here, the largest part of a bare worker's start.
The shuffled order imports it in the training process by the way; an unshuffled dataset with
the user's own ``generator`` did not, until the loader imported it itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from datakit import build_tar_dataset

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh interpreter: its modules are only what the public API imports.
_CHILD = """
import json, os, sys
import torch
from unbroken.data import StatefulLoader, StreamingDataset

def collate(batch):
    return {"n": torch.tensor([len(batch)]), "pid": os.getpid(), "modules": sorted(sys.modules)}

loader = StatefulLoader(StreamingDataset(sys.argv[1], shuffle=False), batch_size=8, num_workers=2,
                        collate_fn=collate, generator=torch.Generator().manual_seed(0))
seen = {}
for batch in loader:
    if batch["pid"] != os.getpid():
        seen.setdefault(batch["pid"], set()).update(batch["modules"])
print(json.dumps({pid: sorted(mods - set(sys.modules)) for pid, mods in seen.items()}))
"""


def test_forked_workers_import_nothing_the_training_process_did_not(tmp_path):
    root = build_tar_dataset(str(tmp_path / "ds"), 200)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, root],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=_TESTS,
    )
    assert out.returncode == 0, out.stderr
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(imported) == 2, f"batches came from {len(imported)} workers, not 2"
    for pid, modules in imported.items():
        assert modules == [], f"worker {pid} imported after its fork: {modules}"
