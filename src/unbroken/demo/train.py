"""The demo training script: ``python -m unbroken.demo.train --dir RUN``.

Trains :class:`TinyGPT` on packed tar shards read by ``StreamingDataset`` +
``StatefulLoader`` (two-level shuffle, O(1) resume state), with dropout, AdamW, a cosine schedule, an EMA and
gradient accumulation, checkpointing the complete state every ``--ckpt-every`` steps. Run it
again with the same ``--dir`` after any crash and it continues on the same trajectory.

Writes ``RUN/metrics.jsonl`` (loss and the sample ids of every step) and ``RUN/ckpt``; packs
the corpus into ``--data`` (default ``RUN/data``) unless it is there already.
``--die-at STEP[:MICRO]`` SIGKILLs this very process just before micro-batch MICRO of step
STEP (tests use it to crash at exact points, e.g. inside an accumulation cycle).

Under torchrun with ``WORLD_SIZE > 1`` it trains data-parallel on gloo: every rank draws the
same global batch ids, trains on its contiguous share of each micro-batch and the gradients
are averaged. The sample order is therefore the same for any world size (``unbroken drill``
uses this for its world-size-change fault); the floats are not (other reduction order).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from unbroken.ckpt import CheckpointConfig, Checkpointer, TrainState
from unbroken.common.metrics import MetricLog
from unbroken.data.manifest import MANIFEST_NAME
from unbroken.data.prepare.pack import pack
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.stream.loader import StatefulLoader
from unbroken.demo.model import TinyGPT, synthetic_corpus
from unbroken.elastic import beat, finishing

__all__ = ["CTX", "collate_tokens", "main", "prepare_data"]


CTX = 32  # characters of context


def prepare_data(data_dir: str, seed: int, ctx: int) -> int:
    """Pack the synthetic corpus into tar shards (once); returns the vocabulary size.

    Each sample is ``ctx + 1`` character ids (``<key>.tok``, uint8): inputs and the targets
    shifted by one. Skipped when ``data_dir`` already holds a complete dataset.
    """
    data, vocab = synthetic_corpus(64 * 1024, seed)
    if os.path.exists(os.path.join(data_dir, MANIFEST_NAME)):
        return vocab
    n_seq = (len(data) - 1) // ctx
    rows = (data[i * ctx : (i + 1) * ctx + 1].astype(np.uint8) for i in range(n_seq))
    samples = ({"__key__": f"{i:06d}", "tok": r.tobytes()} for i, r in enumerate(rows))
    # ~8 shards: the two-level shuffle (shard order + window) has something to mix.
    pack(samples, data_dir, shard_size=256 << 10, progress=False)
    return vocab


def collate_tokens(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"ids": [sample ids], "x": LongTensor[B, ctx], "y": LongTensor[B, ctx]}``."""
    rows = np.stack([np.frombuffer(s["tok"], dtype=np.uint8) for s in samples]).astype(np.int64)
    t = torch.from_numpy(rows)
    return {"ids": [int(s["__key__"]) for s in samples], "x": t[:, :-1], "y": t[:, 1:]}


def _batches(loader: StatefulLoader) -> Iterator[dict[str, Any]]:
    """Batches across epoch ends (each pass continues where the loader's state says)."""
    while True:
        yield from loader


def _average_gradients(model: torch.nn.Module, world: int) -> None:
    """All-reduce every gradient in one flat buffer (a fixed order: deterministic)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--data", default=None, help="packed dataset dir (default: DIR/data)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--keep-last", type=int, default=CheckpointConfig.keep_last)
    p.add_argument(
        "--memory-every",
        type=int,
        default=CheckpointConfig.memory_every_steps,
        help="also publish to the memory tier every K steps (default: off)",
    )
    p.add_argument("--die-at", default=None, help="STEP[:MICRO]: SIGKILL self there")
    p.add_argument(
        "--break",
        dest="broken",
        default=None,
        choices=["rng", "data", "optimizer", "scheduler"],
        help="(tests) deliberately drop one part of the state on restore",
    )
    return p.parse_args(argv)


def _init_dist(batch: int) -> tuple[int, int]:
    """(rank, world size); joins the gloo group under torchrun with several ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if batch % world:
        raise ValueError(f"--batch {batch} is not divisible by the world size {world}")
    dist.init_process_group("gloo")
    return dist.get_rank(), world


@dataclass
class _Run:
    """What the loop trains and saves: the parts and the TrainState holding them."""

    model: TinyGPT
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    ema: torch.optim.swa_utils.AveragedModel
    loader: StatefulLoader
    metrics: MetricLog
    state: TrainState
    ckpt: Checkpointer


def _build(a: argparse.Namespace, rank: int, world: int) -> _Run:
    """The model, optimizer, schedule, EMA, loader and metric log, as one TrainState."""
    data_dir = a.data or os.path.join(a.dir, "data")
    if rank == 0:
        vocab = prepare_data(data_dir, a.seed, CTX)
    if world > 1:
        n = torch.tensor([vocab if rank == 0 else 0])
        dist.broadcast(n, src=0)  # also: the data is ready for every rank
        vocab = int(n)
    torch.manual_seed(a.seed)
    model = TinyGPT(vocab, ctx=CTX)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)
    )
    if world > 1:  # same initial weights everywhere, one dropout stream per rank
        torch.manual_seed(a.seed * 1_000_003 + rank + 1)
    # Every rank reads the same global batch (rank 0 of 1) and trains on its share, so the
    # sample order is the same for any world size.
    dataset = StreamingDataset(data_dir, seed=a.seed, rank=0, world_size=1)
    loader = StatefulLoader(
        dataset, batch_size=a.batch, collate_fn=collate_tokens, last_batch="drop"
    )
    # every rank holds a metric log (rank 0 writes it): the same components on every rank
    metrics = MetricLog(os.path.join(a.dir, "metrics.jsonl"))
    state = TrainState(
        model=model, optimizer=opt, scheduler=sched, ema=ema, loader=loader, metrics=metrics
    )
    ckpt = Checkpointer(
        os.path.join(a.dir, "ckpt"),
        state,
        every_steps=a.ckpt_every,
        keep_last=a.keep_last,
        memory_every_steps=a.memory_every,
    )
    return _Run(model, opt, sched, ema, loader, metrics, state, ckpt)


def _restore(r: _Run, broken: str | None) -> int:
    """``ckpt.restore()``; with ``--break PART`` (tests) that part is then put back as it
    was before the restore, as a resume that forgets it would."""
    parts: dict[str, tuple[Any, Any]] = {
        "rng": (torch.get_rng_state, torch.set_rng_state),
        "data": (r.loader.state_dict, r.loader.load_state_dict),
        "optimizer": (r.opt.state_dict, r.opt.load_state_dict),
        "scheduler": (r.sched.state_dict, r.sched.load_state_dict),
    }
    before = parts[broken][0]() if broken else None
    start = r.ckpt.restore() or 0
    if broken and start:
        parts[broken][1](before)
    return start


def _train_step(
    a: argparse.Namespace,
    r: _Run,
    batches: Iterator[dict[str, Any]],
    rank: int,
    world: int,
    die: tuple[int, int] | None,
) -> None:
    """One optimizer step of ``a.accum`` micro-batches; logs loss and the sample ids."""
    model, state = r.model, r.state
    step = state.step
    loss_sum = 0.0
    ids_all: list[int] = []
    for micro in range(a.accum):
        if die == (step + 1, micro):
            os.kill(os.getpid(), signal.SIGKILL)
        batch = next(batches)
        ids_all.extend(batch["ids"])
        x, y = batch["x"], batch["y"]
        if world > 1:  # this rank's contiguous share of the global micro-batch
            share = a.batch // world
            x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        loss = model(x, y) / a.accum
        loss.backward()
        loss_sum += float(loss)
        state.micro_step = micro + 1
    if world > 1:
        _average_gradients(model, world)
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total)
        loss_sum = float(total) / world
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    r.opt.step()
    r.opt.zero_grad(set_to_none=True)
    r.sched.step()
    r.ema.update_parameters(model)
    state.micro_step = 0
    state.step = step + 1
    state.samples += len(ids_all)
    state.tokens += len(ids_all) * CTX
    r.metrics.log(state.step, loss=loss_sum, ids=ids_all, world_size=world)


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
    rank, world = _init_dist(a.batch)
    r = _build(a, rank, world)
    start = _restore(r, a.broken)
    r.model.train()
    batches = _batches(r.loader)
    for _ in range(start, a.steps):
        _train_step(a, r, batches, rank, world, die)
        r.ckpt.maybe_save()
        beat(r.state.step)  # progress for the supervisor's hang watchdog (no-op without one)
    finishing()  # the final save and the teardown get --shutdown-timeout, not --hang-timeout
    final = r.state.step not in r.ckpt.store.steps()
    if world > 1:  # saving is collective: every rank must take the same branch
        flag = torch.tensor([int(final)])
        dist.broadcast(flag, src=0)
        final = bool(flag)
    if final:
        r.ckpt.save()
    r.metrics.close()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
