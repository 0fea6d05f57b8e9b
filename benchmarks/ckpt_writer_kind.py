"""Background writer: thread vs process — what each costs the training loop while it writes.

    .venv/bin/python benchmarks/ckpt_writer_kind.py --gib 1 --saves 3

Both variants block the loop only for the copy into reusable host buffers; they differ in
where the write (DCP serialisation, xxh3 hashing, fsync) runs:

* thread  — ``Checkpointer(async_save=True)`` as shipped: a writer thread in the trainer.
* process — a persistent writer process; the snapshot buffers live in shared memory
  (``share_memory_()``) and each save only sends a message (step, directory).

Measured for each: the blocking snapshot, the write's duration, and the training loop's
mean step time while the write is in flight vs with no save at all (a small MLP step, torch
threads = 1, so the writer has the second core).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.multiprocessing as mp

warnings.filterwarnings("ignore", message="torch.distributed is")


def make_state(gib: float) -> dict[str, torch.Tensor]:
    n = max(1, round(gib * (1 << 30) / (4096 * 4096 * 4)))
    return {f"t{i}": torch.randn(4096, 4096) for i in range(n)}


class _Blob:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.t = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.t

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.t = sd


def _writer_proc(buffers: dict[str, torch.Tensor], inbox: mp.Queue, outbox: mp.Queue) -> None:
    from unbroken.ckpt.tensor_io import write_tensors

    torch.set_num_threads(1)
    while True:
        msg = inbox.get()
        if msg is None:
            return
        t0 = time.perf_counter()
        write_tensors(msg, buffers, threads=2)
        outbox.put(time.perf_counter() - t0)


def _trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    return m, torch.optim.SGD(m.parameters(), lr=1e-3)


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _steps_while(busy, m, opt, x) -> list[float]:
    times = []
    while busy():
        t = time.perf_counter()
        _step(m, opt, x)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="ub-writer-")
    state = make_state(a.gib)
    m, opt = _trainer()
    x = torch.randn(64, 256)
    for _ in range(20):
        _step(m, opt, x)
    base = []
    for _ in range(200):
        t = time.perf_counter()
        _step(m, opt, x)
        base.append(time.perf_counter() - t)
    base_ms = statistics.median(base) * 1e3

    from unbroken.ckpt import Checkpointer, TrainState

    rows: dict[str, dict[str, list[float]]] = {"thread": {}, "process": {}}
    st = TrainState(extras={"blob": _Blob(state)}, capture_rng=False)
    ck = Checkpointer(os.path.join(root, "thread"), st, async_save=True, keep_last=1)
    for i in range(a.saves):
        st.step = i
        t0 = time.perf_counter()
        ck.save()
        blocked = time.perf_counter() - t0
        fut = ck._inflight
        during = _steps_while(lambda: fut is not None and not fut.done(), m, opt, x)
        ck.wait()
        r = rows["thread"]
        r.setdefault("blocked", []).append(blocked)
        r.setdefault("write", []).append(time.perf_counter() - t0)
        r.setdefault("step_ms", []).append(
            statistics.median(during) * 1e3 if during else float("nan")
        )
    ck.close()

    bufs = {k: torch.empty_like(v).share_memory_() for k, v in state.items()}
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_writer_proc, args=(bufs, inbox, outbox), daemon=True)
    proc.start()
    for i in range(a.saves):
        d = os.path.join(root, f"proc-{i}")
        os.makedirs(d)
        t0 = time.perf_counter()
        for k, v in state.items():
            bufs[k].copy_(v)
        inbox.put(d)
        blocked = time.perf_counter() - t0
        during = _steps_while(lambda: outbox.empty(), m, opt, x)
        outbox.get()
        r = rows["process"]
        r.setdefault("blocked", []).append(blocked)
        r.setdefault("write", []).append(time.perf_counter() - t0)
        r.setdefault("step_ms", []).append(
            statistics.median(during) * 1e3 if during else float("nan")
        )
        shutil.rmtree(d)
    inbox.put(None)
    proc.join()
    shutil.rmtree(root, ignore_errors=True)

    gb = sum(v.numel() * 4 for v in state.values()) / 1e9
    print(f"\nstate {gb:.2f} GB; training step alone: {base_ms:.2f} ms (median of 200)")
    print(
        "| writer | snapshot blocks loop (s, later saves) | write done after (s) | step time while writing (ms) | vs no save |"
    )
    print("|---|---|---|---|---|")
    for kind, r in rows.items():
        later = slice(1, None) if len(r["blocked"]) > 1 else slice(None)
        step = statistics.median(r["step_ms"][later])
        print(
            f"| {kind} | {statistics.median(r['blocked'][later]):.3f} | {statistics.median(r['write'][later]):.2f} "
            f"| {step:.2f} | {step / base_ms:.2f}x |"
        )


if __name__ == "__main__":
    main()
