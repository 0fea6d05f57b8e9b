"""The memory tier with two real gloo ranks (issue 25: "all ranks agree: the newest step
every rank can load"; C-TIERS, C-PER-RANK).

Phase 1: two spawned ranks train 7 steps with ``memory_every_steps=1, every_steps=5`` and
exit without closing (their slots stay). Then rank 1's newest slot is damaged or removed.
Phase 2: two fresh ranks restore: both must take step 6 from memory (the newest step both
hold), each rank its own per-rank state, bit-exact; with every slot of rank 1 gone, both
take the disk tier's step 5.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from ckptkit import Pristine, flip, report_and_exit, spawn_two
from rankkit import join_group

pytestmark = pytest.mark.slow


class _PerRank:
    """State that differs between ranks (restored to the same rank, C-PER-RANK)."""

    def __init__(self, v: float) -> None:
        self.v = torch.tensor([v])

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.v}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.v = sd["v"].clone()


def _worker(rank: int, world: int, job: dict[str, Any]) -> None:
    from unbroken.ckpt import Checkpointer, TrainState

    join_group(rank, world, job["rdzv"])
    torch.manual_seed(0 if job["mode"] == "train" else 99)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mine = _PerRank(-1.0)
    st = TrainState(model=model, optimizer=opt, extras={"mine": mine}, seed=1)
    ck = Checkpointer(job["root"], st, every_steps=5, memory_every_steps=1, memory_dir=job["tier"])
    out: dict[Any, Any] = {}
    if job["mode"] == "train":
        assert ck.restore() is None
        for step in range(1, 8):
            model(torch.ones(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mine.v = torch.tensor([rank * 100.0 + step])
            st.step = step
            ck.maybe_save()
            ck.wait()
            out[step] = [float(model.weight.sum()), float(mine.v)]
    else:
        got = ck.restore()
        out = {"step": got, "tier": ck.restored_tier}
        out["state"] = [float(model.weight.sum()), float(mine.v)]
    report_and_exit(job, rank, out)


def _run(job: dict[str, Any]) -> None:
    spawn_two(_worker, job)


def _job(base: str, mode: str) -> dict[str, Any]:
    tier = os.path.join(base, "unbroken-t", "job")
    return {"mode": mode, "root": os.path.join(base, "ckpt"), "tier": tier, "out": base}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    """Phase 1, once for the module; each test gets it back untouched."""
    base = str(tmp_path_factory.mktemp("trained"))
    _run(_job(base, "train"))
    return Pristine(base)


@pytest.mark.parametrize("damage", ["flip", "remove", "remove-all"])
def test_ranks_agree_on_the_newest_step_every_rank_holds(trained: Pristine, damage: str) -> None:
    job = _job(trained.fresh(), "load")
    tier, out = job["tier"], job["out"]
    states = [json.load(open(os.path.join(out, f"train-{r}.json"))) for r in range(2)]
    rank1 = os.path.join(tier, "rank-1")
    slots = [os.path.join(rank1, f"slot-{i}") for i in range(2)]
    newest = max(slots, key=os.path.getmtime)  # step 7 (the slots alternate)
    if damage == "flip":
        flip(newest, os.path.getsize(newest) - 7)
    elif damage == "remove":
        os.unlink(newest)
    else:
        for p in slots:
            os.unlink(p)
    _run(job)
    want_step, want_tier = (5, "disk") if damage == "remove-all" else (6, "memory")
    for r in range(2):
        got = json.load(open(os.path.join(out, f"load-{r}.json")))
        assert (got["step"], got["tier"]) == (want_step, want_tier), (r, got)
        assert got["state"] == states[r][str(want_step)], (r, got, states[r])
