"""Batches held across a save *and* an epoch end (``held_batches >= 2``).

A loop that holds two batches (a DevicePrefetcher-style double buffer drawn with
``next()``) and saves right after the first batch of a new epoch holds the last batch of
the previous epoch too. The saved position must lie before *both*: the resumed run delivers
them again, and what the loop used before the save plus what it gets after the restore is
the uninterrupted run, batch for batch.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from datakit import build_tar_dataset, ids_collate
from unbroken.data import StatefulLoader, StreamingDataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
BATCHES = 20  # 6 batches an epoch: a little over three epochs


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tar_dataset(str(tmp_path_factory.mktemp("held") / "d"), 23)


def _loader(path: str, held: int, workers: int = 0) -> StatefulLoader:
    ds = StreamingDataset(path, seed=3, shuffle_window=8)
    return StatefulLoader(
        ds, batch_size=4, collate_fn=ids_collate, held_batches=held, num_workers=workers
    )


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("held", [1, 2, 3])
def test_batches_held_across_an_epoch_end_are_delivered_again(data, held, workers) -> None:
    ref_it = _loader(data, 0).forever()
    ref = [next(ref_it) for _ in range(BATCHES)]
    assert len(_loader(data, 0)) == 6
    for cut in (held, 5, 6, 7, 8, 12, 13):
        if cut < held:
            continue
        it = _loader(data, held, workers).forever()
        drawn: list[Any] = [next(it) for _ in range(cut)]
        state = json.loads(json.dumps(it.state_dict()))
        used = drawn[: cut - held]  # the last `held` batches are still held, not used
        again = _loader(data, held, workers)
        again.load_state_dict(state)
        it2 = again.forever()
        rest = [next(it2) for _ in range(BATCHES - len(used))]
        assert rest[:held] == drawn[cut - held :], (held, cut, state)
        assert used + rest == ref, (held, cut, state)
        it.close()
        it2.close()


def test_take_ids_keeps_batches_held_across_an_epoch_end(data) -> None:
    """take_ids lists what was consumed: a batch of the last epoch still held is not."""
    ds = StreamingDataset(data, seed=3, shuffle_window=8)
    it = _loader(data, 2).forever()
    for _ in range(7):  # the whole epoch 0 and the first batch of epoch 1 drawn
        next(it)
    ids = it.take_ids()  # epoch 0's first 5 batches (20 positions) consumed, 2 batches held
    assert ids == ds.sample_ids(0, np.arange(20)).tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_closing_or_breaking_out_keeps_the_held_batch_unconsumed(data, workers) -> None:
    """``Endless.close()`` "stops the workers, the position stays", and a ``break`` out of a
    pass keeps the delivered position: a save after either still leaves the held batch
    unconsumed, so the resumed run delivers it first."""
    it = _loader(data, 1, workers).forever()
    drawn = [next(it) for _ in range(3)]
    before = it.state_dict()
    it.close()
    assert it.state_dict() == before
    again = _loader(data, 1)
    again.load_state_dict(before)
    assert next(again.forever()) == drawn[-1]

    loader = _loader(data, 1, workers)
    held: Any = None
    for i, batch in enumerate(loader):
        held = batch
        if i == 2:
            before = loader.state_dict()
            break
    assert loader.state_dict() == before
    again = _loader(data, 1)
    again.load_state_dict(before)
    assert next(iter(again)) == held
