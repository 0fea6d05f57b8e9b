"""`unbroken ckpt export|verify|inspect` on a checkpoint sharded over 2 real gloo ranks: the
export consolidates every rank's DCP chunks into full tensors."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor  # imported once, before the ranks fork
import torch.multiprocessing as tmp_mp
from safetensors.torch import load_file

from rankkit import group_file, join_group
from unbroken.ckpt import Checkpointer, TrainState
from unbroken.cli import main

pytestmark = pytest.mark.slow

WORLD = 2


def _full() -> dict[str, torch.Tensor]:
    return {
        "proj.weight": torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6) / 7,  # uneven rows
        "proj.bias": torch.arange(10, dtype=torch.bfloat16),
        "cols": torch.arange(4 * 9, dtype=torch.int64).reshape(4, 9),  # sharded along dim 1
    }


class _ShardedModel:
    """An FSDP2-like model: every parameter a DTensor sharded over all ranks."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, Any]:
        return dict(self.sd)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = dict(sd)


def _worker(rank: int, root: str, rdzv: str) -> None:
    """A rank forked from the test process (torch, DTensor and unbroken are imported there
    already: a spawned rank would import them again, ~5 CPU-s each, for nothing this proves)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    join_group(rank, WORLD, rdzv)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        sd = {
            k: distribute_tensor(v, mesh, [Shard(1 if k == "cols" else 0)])
            for k, v in _full().items()
        }
        st = TrainState(model=_ShardedModel(sd))
        st.step = 5
        ck = Checkpointer(root, st)
        ck.save()
        ck.close()
    finally:
        dist.destroy_process_group()


def test_export_consolidates_a_checkpoint_sharded_over_two_ranks(tmp_path, capsys) -> None:
    root = str(tmp_path / "ckpt")
    tmp_mp.start_processes(
        _worker,
        args=(root, group_file(str(tmp_path))),
        nprocs=WORLD,
        start_method="fork",
        join=True,
    )
    d = os.path.join(root, "step-00000005")
    assert {f"__{r}_0.distcp" for r in range(WORLD)} <= set(os.listdir(d))  # one file per rank
    with open(os.path.join(d, "manifest.json")) as f:
        tensors = json.load(f)["tensors"]
    for k in _full():
        meta = tensors[f"components/model/{k}"]
        assert meta["sharded"] and len({c["file"] for c in meta["chunks"]}) == WORLD, k

    out = str(tmp_path / "model.safetensors")
    assert main(["ckpt", "export", root, "--to", out]) == 0
    got = load_file(out)
    want = _full()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k

    assert main(["ckpt", "verify", root]) == 0
    assert main(["ckpt", "inspect", root]) == 0
    text = capsys.readouterr().out
    assert "world size      2" in text and "10x6" in text
