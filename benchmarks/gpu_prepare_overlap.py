"""Does allocating the async save's pinned buffers in the background slow a GPU loop?

``Checkpointer(async_save=True)`` has its checkpoint thread allocate (``cudaHostAlloc``) and
fault in one host copy of the state at the first step boundary (``maybe_save``) or right
after a restore, so the first save only copies. On the H200 that allocation takes 3.5-6.2 s
for 8.25 GiB (``gpu_checks.py`` [2]). This script times a GPU loop (a chain of matmuls, one
``synchronize`` per step, as a loop that logs its loss) while that allocation runs on the
checkpoint thread, against the same loop before it and after it finished.

Usage (repository root, on the GPU machine; the image's python3 has torch):
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_prepare_overlap.py --json $OUT/overlap.json
    .venv/bin/python benchmarks/gpu_prepare_overlap.py --smoke     # tiny CPU run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import unbroken  # noqa: F401
except ImportError:  # the GPU machine's python3 has torch; not us
    sys.path.insert(0, os.path.join(HERE, "..", "src"))

sys.path.insert(0, HERE)

from gpu_checks import big_state  # noqa: E402

from unbroken.ckpt import Checkpointer, TrainState  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8.0, help="state size (model + AdamW)")
    p.add_argument("--steps", type=int, default=40, help="loop steps timed before the allocation")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run to check the script")
    a = p.parse_args(argv)
    if a.smoke:
        dev, a.steps, a.gib = torch.device("cpu"), 4, 0.01
    elif not torch.cuda.is_available():
        print("gpu_prepare_overlap: no CUDA device; --smoke checks it on CPU", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    model, opt = big_state(dev, a.gib)  # the state gpu_checks.py [2] saves
    side = model[0].weight.shape[0]
    x = torch.randn(side, side, device=dev)
    w = torch.randn(side, side, device=dev) / side**0.5

    def step() -> float:
        t0 = time.perf_counter()
        y = x
        for _ in range(8):
            y = y @ w
        _sync(dev)
        return time.perf_counter() - t0

    for _ in range(5):  # warm-up: kernels chosen, clocks up
        step()
    before = [step() for _ in range(a.steps)]
    st = TrainState(model=model, optimizer=opt)
    root = tempfile.mkdtemp(prefix="ub-overlap-")
    ck = Checkpointer(root, st, async_save=True, every_steps=10**9)
    t0 = time.perf_counter()
    ck.maybe_save(1)  # not due: the checkpoint thread starts allocating the buffers
    during: list[float] = []
    prepared = ck._prepared
    while prepared is not None and not prepared.done():
        during.append(step())
    alloc_s = time.perf_counter() - t0
    ck.wait()
    after = [step() for _ in range(a.steps)]
    ck.close()
    med = {k: statistics.median(v) if v else float("nan") for k, v in
           (("before", before), ("during", during), ("after", after))}  # fmt: skip
    res: dict[str, Any] = {
        "device": str(dev),
        "state_gib": sum(t.numel() * 4 for t in model.parameters()) * 3 / 2**30,
        "allocated_bytes": ck._snap.allocated_bytes,
        "allocation_s": alloc_s,
        "steps_during": len(during),
        "median_step_s": med,
        "max_step_during_s": max(during) if during else float("nan"),
        "slowdown_during": med["during"] / med["before"] if during else float("nan"),
    }
    print(
        f"{res['state_gib']:.2f} GiB state, buffers allocated on the checkpoint thread in "
        f"{alloc_s:.2f} s; loop step median before {med['before'] * 1e3:.2f} ms, during "
        f"{med['during'] * 1e3:.2f} ms ({len(during)} steps, slowest "
        f"{res['max_step_during_s'] * 1e3:.2f} ms), after {med['after'] * 1e3:.2f} ms -> "
        f"{res['slowdown_during']:.3f}x while allocating"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
