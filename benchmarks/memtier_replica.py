"""The memory tier's peer replica (issue 25 peer replica item 1): what sending each slot to
the next node costs the training loop at K = 1 on the demo model.

    flock /tmp/unbroken-bench.lock .venv/bin/python benchmarks/memtier_replica.py \
        --blocks 10 --block 20

Two spawned gloo ranks on this box are two "nodes" (``UNBROKEN_MEMORY_JUMP=1``, a memory
directory each). Each rank trains the demo's TinyGPT (vocab 96, ctx 32, 8 samples per rank,
AdamW, one thread, gradients all-reduced as DDP does) in alternating blocks of ``--block``
steps with two Checkpointers that both publish every step (``memory_every_steps=1``): one
with the peer replica off, one with it on. The median of the per-block ratios of rank 0's
step time (load drifts slower than a pair of blocks): overhead = on / off - 1. Also: the
loop's publish stall (``last_blocked_seconds``, the replica adds only a thread wake-up to
it), and the replica rounds completed. The load average is printed (the box is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from unbroken.ckpt import Checkpointer, TrainState
from unbroken.demo.model import TinyGPT

warnings.filterwarnings("ignore", message="torch.distributed is")


def _rank(rank: int, world: int, a: dict[str, Any]) -> None:
    os.environ.update(UNBROKEN_MEMORY_JUMP="1")
    torch.set_num_threads(1)
    # a file store: no port picked ahead that another process could take first (EADDRINUSE)
    dist.init_process_group("gloo", init_method=f"file://{a['rdzv']}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = TinyGPT(96, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    st = TrainState(model=model, optimizer=opt)
    x = torch.randint(0, 96, (8, 32))

    def ckpt(name: str, replica: bool) -> Checkpointer:
        return Checkpointer(
            os.path.join(a["tmp"], name),
            st,
            async_save=True,
            memory_every_steps=1,
            memory_replica=replica,
            memory_dir=os.path.join(a["tmp"], f"unbroken-node{rank}", name),
        )

    off, on = ckpt("off", False), ckpt("on", True)
    stalls: dict[int, list[float]] = {id(off): [], id(on): []}

    def run(ck: Checkpointer) -> float:
        t0 = time.perf_counter()
        for _ in range(a["block"]):
            model(x, x).backward()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            st.step += 1
            ck.maybe_save()
            stalls[id(ck)].append(ck.last_blocked_seconds or 0.0)
        ck.wait()
        return (time.perf_counter() - t0) / a["block"]

    run(on), run(off)  # warm-up: buffers, slots, the replica's thread and first transfer
    t_off, t_on, ratios = [], [], []
    for i in range(a["blocks"]):
        pair = (run(off), run(on)) if i % 2 == 0 else tuple(reversed((run(on), run(off))))
        t_off.append(pair[0])
        t_on.append(pair[1])
        ratios.append(pair[1] / pair[0])
    replica = on._memory.replica if on._memory is not None else None
    drained = replica.drain(60) if replica is not None else False
    out = {
        "rank": rank,
        "step_off_ms": statistics.median(t_off) * 1e3,
        "step_on_ms": statistics.median(t_on) * 1e3,
        "overhead_pct": (statistics.median(ratios) - 1) * 100,
        "stall_off_ms": statistics.median(stalls[id(off)]) * 1e3,
        "stall_on_ms": statistics.median(stalls[id(on)]) * 1e3,
        "replica_rounds": replica._done if replica is not None else 0,
        "replica_step": replica.received if replica is not None else None,
        "replica_stopped": replica.stopped if replica is not None else "no replica",
        "drained": drained,
        "load": os.getloadavg(),
    }
    with open(os.path.join(a["tmp"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    on.close()
    off.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rdzv = os.path.join(tempfile.mkdtemp(prefix="rdzv-", dir=tmp), "store")
        args = {"tmp": tmp, "rdzv": rdzv, "blocks": a.blocks, "block": a.block}
        print(f"load average before: {os.getloadavg()}", file=sys.stderr)
        tmp_mp.start_processes(_rank, args=(2, args), nprocs=2, start_method="spawn", join=True)
        res = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                res.append(json.load(f))
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
