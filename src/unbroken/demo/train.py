"""The demo training script: ``python -m unbroken.demo.train --dir RUN``.

Trains :class:`TinyGPT` with dropout, shuffled data, AdamW, a cosine schedule, an EMA and
gradient accumulation, checkpointing the complete state every ``--ckpt-every`` steps. Run it
again with the same ``--dir`` after any crash and it continues on the same trajectory.

Writes ``RUN/metrics.jsonl`` (loss and the sample ids of every step) and ``RUN/ckpt``.
``--die-at STEP[:MICRO]`` SIGKILLs this very process just before micro-batch MICRO of step
STEP (tests use it to crash at exact points, e.g. inside an accumulation cycle).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

import numpy as np
import torch

from unbroken.ckpt import Checkpointer, TrainState
from unbroken.elastic import beat
from unbroken.demo.model import TinyGPT, synthetic_corpus
from unbroken.metrics import MetricLog

__all__ = ["EpochSampler", "main"]


class EpochSampler:
    """In-memory shuffled batches with a tiny resume state ``{epoch, pos}``.

    Each epoch is a permutation seeded by ``(seed, epoch)``: resuming needs no replay.
    """

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch, self.seed = n, batch, seed
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def next_ids(self) -> np.ndarray:
        if self.pos + self.batch > self.n:  # drop_last, then a new epoch
            self.epoch, self.pos = self.epoch + 1, 0
            self._perm = self._permutation()
        ids = self._perm[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return ids

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])
        self._perm = self._permutation()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--die-at", default=None, help="STEP[:MICRO]: SIGKILL self there")
    p.add_argument(
        "--break",
        dest="broken",
        default=None,
        choices=["rng", "data", "optimizer", "scheduler"],
        help="(tests) deliberately drop one part of the state on restore",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    torch.set_num_threads(1)  # bit-identical CPU runs regardless of the host's core count
    torch.use_deterministic_algorithms(True)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    die = None
    if a.die_at:
        s, _, m = a.die_at.partition(":")
        die = (int(s), int(m or 0))

    torch.manual_seed(a.seed)
    ctx = 32
    data, vocab = synthetic_corpus(64 * 1024, a.seed)
    n_seq = (len(data) - 1) // ctx
    x_all = torch.from_numpy(data[: n_seq * ctx].reshape(n_seq, ctx))
    y_all = torch.from_numpy(data[1 : n_seq * ctx + 1].reshape(n_seq, ctx))

    model = TinyGPT(vocab, ctx=ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)
    )
    sampler = EpochSampler(n_seq, a.batch, a.seed)
    metrics = MetricLog(os.path.join(a.dir, "metrics.jsonl"))
    state = TrainState(
        model=model, optimizer=opt, scheduler=sched, ema=ema, loader=sampler, metrics=metrics
    )
    ckpt = Checkpointer(
        os.path.join(a.dir, "ckpt"), state, every_steps=a.ckpt_every, keep_last=a.keep_last
    )

    snapshot: dict[str, Any] = {}
    if a.broken:  # capture what we are about to "forget" so the restore can be undone
        snapshot = {
            "rng": torch.get_rng_state(),
            "data": sampler.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
        }
    start = ckpt.restore() or 0
    if a.broken and start:
        {
            "rng": lambda: torch.set_rng_state(snapshot["rng"]),
            "data": lambda: sampler.load_state_dict(snapshot["data"]),
            "optimizer": lambda: opt.load_state_dict(snapshot["optimizer"]),
            "scheduler": lambda: sched.load_state_dict(snapshot["scheduler"]),
        }[a.broken]()

    model.train()
    for step in range(start, a.steps):
        loss_sum = 0.0
        ids_all: list[int] = []
        for micro in range(a.accum):
            if die == (step + 1, micro):
                os.kill(os.getpid(), signal.SIGKILL)
            ids = sampler.next_ids()
            ids_all.extend(int(i) for i in ids)
            loss = model(x_all[ids], y_all[ids]) / a.accum
            loss.backward()
            loss_sum += float(loss)
            state.micro_step = micro + 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        ema.update_parameters(model)
        state.micro_step = 0
        state.step = step + 1
        state.samples += len(ids_all)
        state.tokens += len(ids_all) * ctx
        metrics.log(state.step, loss=loss_sum, ids=ids_all)
        ckpt.maybe_save()
        beat(state.step)  # progress for the supervisor's hang watchdog (no-op without one)
    if state.step not in ckpt.store.steps():
        ckpt.save()
    metrics.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
