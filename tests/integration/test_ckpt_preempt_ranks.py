"""Preemption across ranks: a SIGTERM seen by one rank stops every rank at the same step.

Signals reach the ranks of a job at different moments (the scheduler, then torchrun's agent,
forward them one process at a time), so one rank may see SIGTERM a step before the others.
The preemption save is collective: if the ranks disagreed on the step, one rank would wait in
the checkpoint's collectives while the others wait in the training loop's all-reduce — a hang.
Here only rank 1 ever receives SIGTERM (the extreme skew), a background save and a
time-based save are in flight as well, and both ranks must save the same step and exit 143.

Before exiting, the checkpointer's own gloo groups are destroyed and their threads joined: a
gloo worker thread still holding a finished collective while the interpreter finalizes
aborted the process (SIGABRT, "terminate called without an active exception") in about 1
run in 10 on a loaded box. The test checks that condition directly (no thread of those groups
outlives the exit path), not only by luck of the timing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rankkit import group_file, join_group

pytestmark = pytest.mark.slow

WORLD = 2
SIGNAL_AT = 9  # rank 1 receives SIGTERM during this step; rank 0 never does


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _worker(rank: int, rdzv: str, root: str, out: str) -> None:
    from unbroken.ckpt import Checkpointer, TrainState

    join_group(rank, WORLD, rdzv)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = TrainState(model=model, optimizer=opt)
    model(torch.randn(8, 32))  # torch's own worker threads exist from here on
    threads = _threads()
    ck = Checkpointer(
        root, st, every_steps=4, every_seconds=0.02, async_save=True, save_on_sigterm=True
    )
    for step in range(1, 200):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        for p in model.parameters():  # the loop's own collectives (as DDP's gradient sync)
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        st.step = step
        if rank == 1 and step == SIGNAL_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"last_step": step}, f)
        try:
            ck.maybe_save()  # exits 143 once any rank was preempted
        except SystemExit:
            with open(os.path.join(out, f"threads{rank}.json"), "w") as f:
                json.dump({"before": threads, "at_exit": _threads()}, f)
            raise
    ck.close()
    dist.destroy_process_group()


def test_sigterm_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path) -> None:
    from unbroken.ckpt import read_checkpoint
    from unbroken.ckpt.store import Store

    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    ctx = mp.get_context("spawn")
    rdzv = group_file(out)
    procs = [ctx.Process(target=_worker, args=(r, rdzv, root, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"rank(s) {hung} hung: the ranks disagreed on the preemption step"
    assert [p.exitcode for p in procs] == [143, 143]
    last: list[Any] = [
        json.load(open(os.path.join(out, f"rank{r}.json")))["last_step"] for r in range(WORLD)
    ]
    assert last == [SIGNAL_AT, SIGNAL_AT]
    for r in range(WORLD):  # the checkpointer's groups and pools are gone before exit
        threads = json.load(open(os.path.join(out, f"threads{r}.json")))
        assert threads["at_exit"] == threads["before"], (r, threads)
    assert Store(root).steps()[-1] == SIGNAL_AT
    ckpt = read_checkpoint(root)  # verifies every file's checksum
    assert ckpt["counters"]["step"] == SIGNAL_AT
