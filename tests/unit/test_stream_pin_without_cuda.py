"""``pin_memory=True`` where CUDA is absent: batches arrive unpinned, as torch's
DataLoader delivers them there ("one script runs everywhere"), for token rows too - whose
batches the loader stacks and pins itself instead of through the DataLoader's pin thread."""

from __future__ import annotations

import pytest
import torch

from datakit import build_token_dataset
from unbroken.data import StatefulLoader, StreamingDataset

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
]


@pytest.mark.parametrize(
    "kw",
    [
        {"num_workers": 0},
        {"num_workers": 2, "shm_transport": False},
        {"num_workers": 2, "xy": True, "shm_transport": False},
        {"num_workers": 2},
    ],
    ids=["in-process", "pipe", "pipe-xy", "ring"],
)
def test_pin_memory_without_an_accelerator_delivers_the_same_batches(tmp_path, kw) -> None:
    root = build_token_dataset(str(tmp_path / "tok"), 3, 200, seq_len=8)

    def batches(pin: bool) -> list[torch.Tensor]:
        ld = StatefulLoader(StreamingDataset(root, seed=1), batch_size=4, pin_memory=pin, **kw)
        return [torch.cat(b, 1) if isinstance(b, tuple) else b for b in ld]

    got, want = batches(True), batches(False)
    assert len(got) == len(want) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
