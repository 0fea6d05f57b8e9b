"""Batches held across a save, and eval streams beside the training stream: issue 21 items 1, 6.

nanoGPT draws the next batch right after the forward pass (``X, Y = get_batch()``) and holds
it across the optimizer step - and across a save. ``LoaderConfig.held_batches`` makes the
saved position leave those batches unconsumed: after a restore the next batch is the held one,
directly and through a DevicePrefetcher. An eval loader is a second loader with its own
position: drawing from it changes nothing about the training stream.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unbroken.data import DevicePrefetcher, StatefulLoader, StreamingDataset
from unbroken.data.feed.prefetch import _HostCopier
from unbroken.data.stream.loader import Endless
from unbroken.data.tokens.flat import index_flat


@pytest.fixture(scope="module")
def flat(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("flat")
    out = {}
    for split, n in (("train", 3_000), ("val", 1_000)):
        path = str(d / f"{split}.bin")
        (np.arange(n) % 65_536).astype(np.uint16).tofile(path)
        index_flat(path, vocab_size=65_536, fsync=False)
        out[split] = path
    return out


def _loader(path: str, held: int, **kw) -> StatefulLoader:
    ds = StreamingDataset(path, seq_len=16, windows="random", seed=5)
    return StatefulLoader(ds, batch_size=4, xy=True, held_batches=held, **kw)


def _wrap(loader: StatefulLoader, how: str):
    """(what is saved, what the loop draws from): the loader's endless view, or a
    DevicePrefetcher over it (which is Stateful through it)."""
    it: Endless | DevicePrefetcher = loader.forever()
    if how == "prefetch-queue":  # the queued path (as on CUDA), on the CPU
        it = DevicePrefetcher(it, depth=2, _copier=_HostCopier(None))
    elif how == "prefetch-passthrough":
        it = DevicePrefetcher(it)
    return it, it


def _nanogpt(path: str, held: int, how: str, steps: int, accum: int = 2, **kw):
    """nanoGPT's loop shape: X, Y fetched before the loop; in each micro step the forward
    uses X, Y, then the next X, Y is drawn before the backward. Returns (used, state, held)."""
    loader = _loader(path, held, **kw)
    stateful, it = _wrap(loader, how)
    X, Y = next(it)
    used = []
    for _ in range(steps):
        for _ in range(accum):
            used.append((X.clone(), Y.clone()))  # forward(X, Y)
            X, Y = next(it)  # prefetch the next batch, then backward
    return used, stateful.state_dict(), (X, Y)


@pytest.mark.parametrize("how", ["loader", "prefetch-queue", "prefetch-passthrough"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_held_across_a_save_is_the_first_after_restore(flat, how, workers) -> None:
    """issue 21 item 1: save while a batch is held, restore, the next batch equals the held
    one; the batches used before the save and after the restore are the uninterrupted run's
    - also across an epoch end (176 windows of 16 in 3,000 tokens: 44 batches an epoch)."""
    ref, _, _ = _nanogpt(flat["train"], 1, "loader", 60)
    for steps in (3, 22, 23):
        used, sd, (X, Y) = _nanogpt(flat["train"], 1, how, steps, num_workers=workers)
        again = _loader(flat["train"], 1)
        again.load_state_dict(sd)
        _, it = _wrap(again, how)
        X2, Y2 = next(it)
        assert torch.equal(X2, X) and torch.equal(Y2, Y), (how, steps)
        rest = [(X2, Y2)] + [next(it) for _ in range(2 * (60 - steps) - 1)]
        for (a, b), (c, d) in zip(used + rest, ref, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d)


def test_without_held_batches_the_held_batch_is_lost(flat) -> None:
    """issue 21 item 1: the trap the option removes - with held_batches=0 the state counts the
    held batch as consumed and the restored run skips it (why the README warns about it)."""
    _, sd, (X, _) = _nanogpt(flat["train"], 0, "loader", 3)
    again = _loader(flat["train"], 0)
    again.load_state_dict(sd)
    X2, _ = next(again.forever())
    assert not torch.equal(X2, X)


def test_held_batches_is_validated(flat) -> None:
    with pytest.raises(ValueError, match="held_batches=-1 must be an integer >= 0"):
        _loader(flat["train"], -1)


def test_eval_draws_neither_consume_nor_perturb_the_training_stream(flat) -> None:
    """issue 21 item 6: an eval stream is a second loader (val.bin, or train.bin under its own
    seed) with its own position; drawing eval batches between training steps leaves the
    training batches, the training loader's state and torch's global RNG as they were."""

    def run(with_eval: bool):
        torch.manual_seed(0)
        train = _loader(flat["train"], 1)
        evals = [
            StatefulLoader(
                StreamingDataset(p, seq_len=16, windows="random", seed=s), batch_size=4, xy=True
            ).forever()
            for p, s in ((flat["val"], 5), (flat["train"], 6))
        ]
        it = train.forever()
        seen, states = [], []
        for step in range(30):
            if with_eval and step % 5 == 0:
                for e in evals:
                    for _ in range(4):
                        next(e)
            seen.append(next(it))
            states.append(train.state_dict())
        return seen, states, torch.get_rng_state()

    a, sa, ra = run(False)
    b, sb, rb = run(True)
    assert sa == sb and torch.equal(ra, rb)
    assert all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True)
    )


def test_a_dropped_endless_iterator_stops_its_workers_at_once(flat) -> None:
    """issue 21 item 1: ``loader.forever()`` dropped mid-epoch lets its DataLoader workers go
    when its last reference goes (no reference cycle left for the garbage collector, which
    took ~10 s of worker-join timeouts)."""
    import os
    import time

    from unbroken.common.procs import children_of, is_alive

    before = set(children_of(os.getpid()))
    it = _loader(flat["train"], 1, num_workers=2).forever()
    for _ in range(5):
        next(it)
    workers = set(children_of(os.getpid())) - before
    assert workers
    del it
    deadline = time.monotonic() + 4.0
    while any(is_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(is_alive(p) for p in workers)
