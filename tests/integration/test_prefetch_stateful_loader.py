"""DevicePrefetcher over the real StatefulLoader (DataLoader workers): the state it reports
counts delivered batches only, and resuming from it yields exactly the remainder."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from datakit import ids_collate
from unbroken.data.diagnose.timer import StepTimer
from unbroken.data.feed.prefetch import DevicePrefetcher, _HostCopier
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.stream.loader import StatefulLoader


def loader(root: str, workers: int) -> StatefulLoader:
    ds = StreamingDataset(root, seed=3)
    return StatefulLoader(
        ds, batch_size=8, collate_fn=ids_collate, num_workers=workers, last_batch="drop"
    )


def queued(inner: Any, depth: int) -> DevicePrefetcher:
    # The CUDA path's queue (pull ahead, deliver later) with host "copies", on CPU.
    return DevicePrefetcher(inner, depth=depth, _copier=_HostCopier(None))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers_before,workers_after", [(2, 0), (0, 3)])
def test_resume_from_prefetcher_state_yields_exactly_the_remainder(
    stream_data: Any, workers_before: int, workers_after: int
) -> None:
    root = stream_data("tar")
    reference = [b for b in loader(root, 0)]
    assert len(reference) == 203 // 8

    inner = loader(root, workers_before)
    p = queued(inner, depth=4)
    timer = StepTimer(log_every=0)
    got = []
    for b in timer.wrap(p):
        got.append(b)
        if len(got) == 7:
            break
    sd = p.state_dict()
    assert sd["samples_consumed"] == 7 * 8  # not 11 * 8: four batches were in flight
    assert inner.state_dict()["samples_consumed"] == 11 * 8  # the loader itself is ahead
    p.close()
    assert inner.state_dict() == sd  # close() puts it back at the delivered batch

    fresh = loader(root, workers_after)
    p2 = queued(fresh, depth=2)
    p2.load_state_dict(sd)
    rest = list(p2)
    assert got + rest == reference
    assert timer.steps == 7  # the step broken out of is recorded too (its compute ends there)


def test_new_pass_after_break_continues_at_the_delivered_batch(stream_data: Any) -> None:
    root = stream_data("tar")
    reference = [b for b in loader(root, 0)]
    p = queued(loader(root, 2), depth=3)
    first = []
    for b in p:
        first.append(b)
        if len(first) == 5:
            break
    assert first + list(p) == reference


def _decode(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "x": torch.frombuffer(bytearray(s["bin"][:256]), dtype=torch.uint8),
        "key": s["__key__"],
    }


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_batches_held_by_the_prefetcher_keep_their_ring_slots(stream_data: Any) -> None:
    """Tensor batches arrive in shared-memory slots that workers reuse once a batch is gone;
    batches queued in the prefetcher (and those the loop keeps) must never be overwritten."""
    ds = StreamingDataset(stream_data("tar"), seed=9, transform=_decode)
    reference = list(StatefulLoader(ds, batch_size=8, last_batch="drop"))
    p = queued(StatefulLoader(ds, batch_size=8, num_workers=2, last_batch="drop"), depth=4)
    kept = []
    for i, (got, want) in enumerate(zip(p, reference, strict=True)):
        assert torch.equal(got["x"], want["x"]) and got["key"] == want["key"]
        if i % 4 == 0:
            kept.append((got["x"][2:5], want["x"][2:5]))  # a slice outlives its batch
    assert all(torch.equal(g, w) for g, w in kept)
