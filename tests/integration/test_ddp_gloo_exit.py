"""A DDP job on gloo that checkpoints with unbroken exits: it never hangs in the teardown.

torch 2.13 stashes a Python object (the ``contextvars`` context) in the thread-local state of
every ``backward()``. A collective launched inside the backward (DDP's gradient all-reduce)
copies that state into its gloo work, so the gloo worker thread that finishes the work needs
the GIL to free it. When the script's DDP module is freed, its C++ ``Reducer`` may hold the
last reference to the process group; ``~ProcessGroupGloo`` then joins the worker threads
*with the GIL held* (a Reducer does not release it, a Python ``ProcessGroup`` object does),
and a worker still freeing its work waits for that GIL forever. CI saw it: a rank alive 120 s
after its peer had exited, its main thread in ``~Reducer -> ~ProcessGroupGloo -> join`` and a
``pt_gloo_runloop`` thread in ``~AsyncAllreduceWork -> take_gil``; about 4% of runs of
``test_resume_ranks_bit_identical.py`` on this box.

Here it is made certain rather than rare: rank 1 launches an all-reduce from inside a backward
and leaves; rank 0 joins that all-reduce only once rank 1 is destroying a process group (one
of its gloo worker threads has ended), so the work finishes, and is freed, while rank 1's
destructor joins the worker. The ranks are real processes (this file, run as a script).
Also for a DDP on a group of its own (``process_group=``): the Checkpointer holds the groups
of its TrainState's DDP wrappers as it holds the default group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from rankkit import group_file

pytestmark = pytest.mark.slow

WORLD = 2
RANK_LIMIT_S = 60.0
"""A rank alive this long is stuck (a run takes about 5 s, 15 s on a loaded 2-core box)."""


def _gloo_workers(pid: int) -> int:
    """How many gloo worker threads process ``pid`` has (two per process group)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # the process has ended
        return 0
    count = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except FileNotFoundError:  # that thread has just ended
            pass
    return count


def _rank_main(
    rank: int, rdzv: str, root: str, leaving: str, distributed: bool | None, own_group: bool
) -> None:
    import faulthandler

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from rankkit import join_group
    from unbroken.ckpt import Checkpointer, TrainState

    faulthandler.dump_traceback_later(RANK_LIMIT_S, exit=True)
    join_group(rank, WORLD, rdzv)
    torch.manual_seed(0)
    # own_group: the DDP on a group of its own; the job's groups are then all destroyed by
    # the script, and only the DDP (its attribute, then its Reducer) still holds that one
    ddp = DistributedDataParallel(
        torch.nn.Linear(4, 1), process_group=dist.new_group(backend="gloo") if own_group else None
    )
    group = ddp.process_group
    if distributed is False:  # each rank saves alone, in a directory of its own
        root = f"{root}-{rank}"
    ck = Checkpointer(
        root, TrainState(model=ddp), every_steps=1, quiet=True, distributed=distributed
    )
    ddp(torch.ones(2, 4)).sum().backward()  # one real DDP step on both ranks
    ck.maybe_save()
    ck.close()
    if rank == 1:
        # an all-reduce launched inside a backward, as DDP's are, not waited for here
        x = torch.ones(3, requires_grad=True)
        x.register_hook(lambda g: dist.all_reduce(g.clone(), group=group, async_op=True) and None)
        x.sum().backward()
        with open(leaving + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {_gloo_workers(os.getpid())}")
        os.rename(leaving + ".tmp", leaving)
        dist.destroy_process_group()
        del group
        return  # ddp (and its Reducer) freed here, while the all-reduce is still open
    while not os.path.exists(leaving):
        time.sleep(0.01)
    with open(leaving) as f:
        pid, workers = map(int, f.read().split())
    while _gloo_workers(pid) >= workers:  # rank 1 is in no group's destructor yet
        time.sleep(0.01)
    dist.all_reduce(torch.ones(3), group=group)
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("distributed", "own_group"),
    [(None, False), (False, False), (None, True)],
    ids=["saving-together", "saving-alone", "ddp-on-its-own-group"],
)
def test_a_ddp_rank_whose_last_all_reduce_ends_during_its_teardown_still_exits(
    tmp_path, distributed: bool | None, own_group: bool
) -> None:
    rdzv = group_file(str(tmp_path))
    leaving = str(tmp_path / "rank-1-leaving")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                str(r),
                rdzv,
                str(tmp_path / "ck"),
                leaving,
                str(distributed),
                str(own_group),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    try:  # communicate: a rank's stderr never fills its pipe and blocks it
        errs = [p.communicate(timeout=RANK_LIMIT_S + 30)[1] for p in procs]
        codes = [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert os.path.exists(leaving), errs
    stuck = "\n".join(f"rank {r}:\n{errs[r][-3000:]}" for r, c in enumerate(codes) if c != 0)
    assert codes == [0, 0], f"exit codes {codes}; a rank stuck in its teardown:\n{stuck}"


if __name__ == "__main__":
    rank, rdzv, root, leaving, distributed, own = sys.argv[1:]
    _rank_main(
        int(rank), rdzv, root, leaving, {"None": None, "False": False}[distributed], own == "True"
    )
