"""The remote cache's epoch plan and small parts (no object store needed).

The plan says, for every shard, which span of epoch positions reads it; prefetch, release and
eviction all trust it, so it must cover every read: for every position, the shard that
position's sample lives in is planned for it (single source, no shuffle, mixtures).
"""

from __future__ import annotations

import numpy as np
import pytest

from unbroken.common.config import parse_size
from unbroken.data.stream.config import CacheConfig
from unbroken.data.stream.dataset import Source, StreamingDataset
from unbroken.data.stream.remote import check_cache_config
from unbroken.elastic.faults import DEFAULT_RULES, FaultClass


def _assert_covers(ds: StreamingDataset, epoch: int, bases: dict[int, int]) -> None:
    plan = ds.order.plan(epoch, bases)
    pos = np.arange(ds.epoch_length, dtype=np.int64)
    src, ids = ds.lookup(epoch, pos)
    for i, base in bases.items():
        sel = src == i
        shard, _ = ds._readers[i].locate(ids[sel])
        for p, u in zip(pos[sel].tolist(), (shard + base).tolist(), strict=True):
            assert plan.overlaps(np.array([u]), p, p)[0], (epoch, p, u)
    # next_use: the first span of a unit at or after p is where it is next read
    u = int(plan.uid[len(plan.uid) // 2])
    p = int(plan.lo[len(plan.uid) // 2])
    nu = int(plan.next_use(np.array([u]), p)[0])
    assert nu == epoch * (ds.epoch_length + 1) + p


@pytest.mark.parametrize("shuffle,window", [(True, 40), (True, None), (False, None)])
def test_plan_covers_every_read_of_one_source(stream_data, shuffle, window) -> None:
    ds = StreamingDataset(
        stream_data("tar"), seed=3, shuffle=shuffle, shuffle_window=window, rank=0, world_size=1
    )
    for epoch in (0, 1):
        _assert_covers(ds, epoch, {0: 0})
    plan = ds.order.plan(0, {0: 0})
    n = len(ds._readers[0].manifest.shards)
    assert set(plan.uid.tolist()) == set(range(n))  # every shard is read once an epoch
    if shuffle and window:
        # a shard is planned for whole windows, never for the epoch
        assert int((plan.hi - plan.lo).max()) <= 2 * window


def test_plan_covers_every_read_of_a_mixture(stream_data) -> None:
    ds = StreamingDataset(
        [Source(stream_data("tar"), 0.7), Source(stream_data("tar_b"), 0.3)],
        seed=1,
        shuffle_window=30,
        rank=0,
        world_size=1,
        mix_block=64,
    )
    for epoch in (0, 2):
        _assert_covers(ds, epoch, {0: 0, 1: 1000})


def test_sizes_options_and_the_storage_fault_class() -> None:
    assert parse_size("200GB") == 200 * 10**9
    assert parse_size("1GiB") == 2**30
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError, match="not a size like 256MB"):
        parse_size("lots")
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        CacheConfig(threads=0)
    with pytest.raises(ValueError, match="timeout=0 must be > 0"):
        CacheConfig(timeout=0)
    assert CacheConfig(prefetch_bytes="1MB").cap_bytes == 10**6
    with pytest.raises(ValueError, match=r"s3://b/ds: .* pass cache_dir="):
        check_cache_config(["s3://b/ds"], CacheConfig(cache_limit="1GB"))
    check_cache_config(["/local"], CacheConfig())  # a local source needs no cache_dir
    # a store that failed every retry is a storage fault (probe, then restart), also when
    # torch wraps it in a DataLoader worker's RuntimeError
    text = (
        "RuntimeError: Caught RemoteStorageError in DataLoader worker process 0.\n"
        "unbroken.data.prepare.stage.RemoteStorageError: s3://b/ds/shard-000001.tar: caching failed"
    )
    first = next(r for r in DEFAULT_RULES if r.matches(text, None))
    assert first.fault == FaultClass.STORAGE


def test_the_default_read_ahead_uses_the_room_beyond_the_window_being_read() -> None:
    """issue 22 round 3 item 2: at the least limit (two windows plus one window's read-ahead,
    what the defaults fitted to a 25% cache choose), the read-ahead was one window: the next
    window's shards became targets only when the readers entered the current one, so all of
    them downloaded in a burst (3 rounds of 4 GETs at 4 MB shards) that the readers caught up
    with at every window boundary (measured: 25-78 waits per epoch, 0.4-1.6 s). The room the
    limit holds for a second window is free whenever no reader straddles a boundary (and a
    prefetch never evicts a unit needed sooner), so the default read-ahead is 3/4 of the room
    beyond one window: 1.5 windows at the least limit, still at most 4 windows."""
    from unbroken.data.stream.remote.plan import default_depth

    b = 4 << 20
    need = 36 * b  # 2 windows of 12 shards + 12 ahead (own files left out)
    assert default_depth(12, need, need, b) == 18
    assert default_depth(12, need + 8 * b, need, b) == (24 + 8) * 3 // 4
    assert default_depth(12, need + 1000 * b, need, b) == 48
    assert default_depth(12, None, need, b) == 12


def test_the_read_ahead_into_the_next_epoch_stays_one_window() -> None:
    """issue 22 round 3 item 2: the deeper read-ahead (1.5 windows) stops at one window's
    worth of the next epoch's units, as before: near an epoch's end, more of the next epoch
    read early counted as this epoch's bytes (measured: 1.10-1.11x the dataset in epoch 1,
    0.10x of it epoch 2's units) against the goal of <= 1.1x per epoch."""
    from unbroken.data.stream.order import DatasetOrder
    from unbroken.data.stream.remote.plan import prefetch_targets

    counts = np.full(60, 100, dtype=np.int64)
    order = DatasetOrder([counts], ["fp"], seed=0, shuffle_window=400)
    ep0, ep1 = order.plan(0, {0: 0}), order.plan(1, {0: 0})
    sizes = np.full(60, 1 << 20, dtype=np.int64)
    s = order.length + 1
    p = order.length - 50  # in the last window
    deep, _ = prefetch_targets(ep0, lambda: ep1, p, 18, None, sizes, next_epoch=6)
    nxt = [u for u, prio in deep if prio >= s]
    assert len(nxt) == 6, deep
    assert [u for u, _ in deep if _ >= s] == list(dict.fromkeys(ep1.uid.tolist()))[:6]
    mid, _ = prefetch_targets(ep0, lambda: ep1, 1000, 18, None, sizes, next_epoch=6)
    assert len(mid) > 6 and all(prio < s for _, prio in mid)  # mid-epoch: the whole depth
