"""A DevicePrefetcher's queued path (the CUDA path, run on CPU with host "copies") over a
loader with ``held_batches``: a new pass after a ``break`` (or after ``close()``) continues
after the last delivered batch, as the pass-through path does - the held-batch count is about
what a *save* leaves unconsumed, not where a new pass starts - and a save still leaves the
held batch unconsumed. Real DataLoader worker processes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from datakit import ids_collate
from unbroken.data import DevicePrefetcher, StatefulLoader, StreamingDataset
from unbroken.data.feed.prefetch import _HostCopier

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _loader(root: str, held: int, workers: int = 0) -> StatefulLoader:
    ds = StreamingDataset(root, seed=3, shuffle_window=24)
    return StatefulLoader(
        ds, batch_size=8, collate_fn=ids_collate, held_batches=held, num_workers=workers
    )


def _feed(inner: Any, queued: bool) -> DevicePrefetcher:
    return DevicePrefetcher(inner, depth=3, _copier=_HostCopier(None) if queued else None)


@pytest.mark.parametrize("queued", [False, True])
@pytest.mark.parametrize("held", [0, 1, 2])
def test_a_new_pass_after_break_repeats_nothing(stream_data: Any, held: int, queued: bool):
    root = stream_data("tar")
    ref_it = _loader(root, 0).forever()
    ref = [next(ref_it) for _ in range(40)]  # 26 batches an epoch: into the next epoch
    feed = _feed(_loader(root, held, workers=2).forever(), queued)
    got: list[Any] = []
    for stop in (5, 12, 25, 31):
        for b in feed:
            got.append(b)
            if len(got) == stop:
                break
        # a save here leaves the last `held` batches unconsumed
        state = json.loads(json.dumps(feed.state_dict()))
        again = _feed(_loader(root, held).forever(), queued)
        again.load_state_dict(state)
        assert next(again) == ref[stop - held], (stop, state)
        again.close()
    feed.close()
    for b in feed:
        got.append(b)
        if len(got) == 40:
            break
    assert got == ref
