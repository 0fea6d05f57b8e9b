"""C-IDENTICAL and C-PER-RANK with two real gloo ranks: N straight steps == k steps, SIGKILL
of both ranks, resume and finish, bit for bit on every rank.

What differs between the ranks is the point: DDP with ``broadcast_buffers=False`` (each
rank's BatchNorm statistics are its own), dropout drawn from each rank's torch RNG, the
inputs from a per-rank numpy generator and python ``random``, and a per-rank extra. Each
rank writes its whole final state (model, optimizer, extra, every RNG stream) and its loss
per step; the resumed run must equal the straight one on each rank. The ranks are real
processes (this file, run as a script) killed by a real SIGKILL.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

from rankkit import group_file

pytestmark = pytest.mark.slow

STEPS = 10
WORLD = 2


class _Seen:
    """A per-rank extra: what this rank has seen so far."""

    def __init__(self) -> None:
        self.sum = torch.zeros(4)
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"sum": self.sum, "count": self.count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sum.copy_(sd["sum"])
        self.count = sd["count"]


RANK_LIMIT_S = 120.0
"""A rank alive this long is stuck (a run takes about 8 s, 30 s on a loaded 2-core box)."""


def _rank_main(rank: int, rdzv: str, root: str, out: str, die_at: int, async_save: bool) -> None:
    import faulthandler

    import numpy as np
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from rankkit import join_group
    from unbroken.ckpt import Checkpointer, TrainState

    # A stuck rank prints every thread's stack, then ends, so the test says where. CI saw
    # ranks of this test hang at exit in DDP's teardown (test_ddp_gloo_exit.py: the cause)
    faulthandler.dump_traceback_later(RANK_LIMIT_S, exit=True)
    join_group(rank, WORLD, rdzv)
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)
    )
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
    gen = np.random.default_rng(100 + rank)
    seen = _Seen()
    torch.manual_seed(1 + rank)  # per-rank dropout
    random.seed(7 + rank)
    np.random.seed(9 + rank)
    state = TrainState(
        model=ddp, optimizer=opt, scheduler=sched, extras={"seen": seen},
        numpy_generators={"data": gen}, seed=0,
    )  # fmt: skip
    ck = Checkpointer(root, state, every_steps=3, async_save=async_save, quiet=True)
    start = ck.restore() or 0
    losses: dict[int, float] = {}
    for step in range(start, STEPS):
        x = torch.from_numpy(gen.standard_normal((6, 4)).astype(np.float32))
        x = x * (1 + random.random()) + float(np.random.rand())
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        seen.sum += x.mean(0)
        seen.count += 1
        state.step = step + 1
        losses[state.step] = loss.item()
        ck.maybe_save()
        if state.step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    final = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "seen": seen.state_dict(),
        "rng": [torch.get_rng_state(), random.getstate(), np.random.get_state()],
        "data_rng": gen.bit_generator.state,
    }
    torch.save(final, os.path.join(out, f"final-{rank}.pt"))
    with open(os.path.join(out, f"losses-{rank}-{start}.json"), "w") as f:
        json.dump(losses, f)
    dist.destroy_process_group()


def _run(tmp: str, root: str, out: str, die_at: int, async_save: bool) -> list[int]:
    rdzv = group_file(tmp)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), rdzv, root, out, str(die_at), str(int(async_save))],
            env=env,
        )
        for r in range(WORLD)
    ]
    try:
        return [p.wait(timeout=RANK_LIMIT_S + 30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}/{i}")
    elif hasattr(a, "tobytes"):
        assert a.tobytes() == b.tobytes(), where
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The straight run, once for the module, saving synchronously: a resumed run of either
    save mode must end where it ends (an async save must not touch the trajectory either)."""
    ref = tmp_path_factory.mktemp("straight")
    (ref / "out").mkdir()
    assert _run(str(ref), str(ref / "ck"), str(ref / "out"), 0, False) == [0, 0]
    return ref


@pytest.mark.parametrize(("die_at", "async_save"), [(7, False), (6, True)])
def test_two_ranks_killed_and_resumed_end_bit_identical(
    straight, tmp_path, die_at: int, async_save: bool
) -> None:
    ref, run = straight, tmp_path / "run"
    (run / "out").mkdir(parents=True)
    got = _run(str(tmp_path), str(run / "ck"), str(run / "out"), die_at, async_save)
    assert got == [-signal.SIGKILL] * WORLD, got
    assert _run(str(tmp_path), str(run / "ck"), str(run / "out"), 0, async_save) == [0, 0]
    for r in range(WORLD):
        a = torch.load(ref / "out" / f"final-{r}.pt", weights_only=False)
        b = torch.load(run / "out" / f"final-{r}.pt", weights_only=False)
        _same(a, b, f"rank {r}")
        straight = json.loads((ref / "out" / f"losses-{r}-0.json").read_text())
        (resumed,) = [
            p for p in (run / "out").glob(f"losses-{r}-*.json") if p.name != f"losses-{r}-0.json"
        ]
        for step, loss in json.loads(resumed.read_text()).items():
            assert straight[step] == loss, (r, step)
    bn = [
        torch.load(ref / "out" / f"final-{r}.pt", weights_only=False)["model"]["1.running_mean"]
        for r in range(WORLD)
    ]
    assert not torch.equal(*bn), (
        "the ranks' BatchNorm statistics must differ for the test to mean anything"
    )


if __name__ == "__main__":
    _rank_main(
        int(sys.argv[1]),
        sys.argv[2],
        sys.argv[3],
        sys.argv[4],
        int(sys.argv[5]),
        sys.argv[6] == "1",
    )
