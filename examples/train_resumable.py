"""The README's training loop, runnable on a CPU: ``python examples/train_resumable.py RUN``.

Packs a small synthetic dataset into tar shards (first run only), then trains a tiny MLP with
every resumable piece wired in. Kill it at any moment (Ctrl-C, SIGKILL) and run the same
command again: it continues from the newest verified checkpoint on the same trajectory.
Under the supervisor: ``unbroken run -- examples/train_resumable.py RUN``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from unbroken import MetricLog
from unbroken.ckpt import Checkpointer, TrainState
from unbroken.data import DevicePrefetcher, StatefulLoader, StreamingDataset, pack
from unbroken.elastic import beat, finishing


def decode(sample: dict) -> torch.Tensor:  # runs in the loader's worker processes
    return torch.from_numpy(np.frombuffer(sample["bin"], dtype=np.float32).copy())


def main(run: str, steps: int = 300) -> None:
    data = os.path.join(run, "data")
    if not os.path.exists(os.path.join(data, "dataset.json")):
        rng = np.random.default_rng(0)
        samples = (
            {"__key__": f"{i:06d}", "bin": rng.standard_normal(17).astype(np.float32).tobytes()}
            for i in range(4096)
        )
        pack(samples, data, shard_size=1 << 20, progress=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)  # the same initial weights in every run (restore() then replaces them)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loader = StatefulLoader(
        StreamingDataset(data, seed=0, transform=decode), batch_size=32, num_workers=2
    )
    metrics = MetricLog(os.path.join(run, "metrics.jsonl"))
    state = TrainState(
        model=model, optimizer=opt, scheduler=sched, loader=loader, metrics=metrics, seed=0
    )
    ckpt = Checkpointer(
        os.path.join(run, "ckpt"),
        state,
        every_steps=50,
        keep_last=3,
        async_save=True,
        save_on_sigterm=True,
    )
    state.step = ckpt.restore() or 0
    while state.step < steps:
        for batch in DevicePrefetcher(loader, device=device):
            x, y = batch[:, :16], batch[:, 16:]
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            state.step += 1
            metrics.log(state.step, loss=loss.item())
            ckpt.maybe_save()
            beat(state.step)
            if state.step >= steps:
                break
    finishing()  # the final save and exit get --shutdown-timeout, not --hang-timeout
    ckpt.close()
    print(f"done at step {state.step}")  # a restart after the last step trains no step


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "example-run")
