"""The epoch order, the mixture and the rank/batch partition (property-based)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from unbroken.data.stream.order import (
    EpochOrder,
    MixtureOrder,
    Partition,
    default_shuffle_window,
    mix_seed,
    mix_seeds,
    shards_per_window,
)

counts_st = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=12).filter(
    lambda c: sum(c) > 0
)
_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(
    counts=counts_st,
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 1000),
    window=st.one_of(st.none(), st.integers(1, 100)),
)
def test_each_epoch_is_a_permutation_and_lookups_are_consistent(counts, seed, epoch, window):
    o = EpochOrder(counts, "fp", seed, epoch, shuffle_window=window)
    n = sum(counts)
    full = o.ids(np.arange(n))
    assert sorted(full.tolist()) == list(range(n))
    # A fresh object, asked for positions in a scrambled order and in pieces, agrees.
    o2 = EpochOrder(counts, "fp", seed, epoch, shuffle_window=window)
    probe = np.random.default_rng(seed % 1000).permutation(n)
    for chunk in np.array_split(probe, 3):
        np.testing.assert_array_equal(o2.ids(chunk), full[chunk])
    # locate() inverts the id numbering: shard i holds ids starts[i]..starts[i+1]-1
    shard, local = o.locate(full)
    assert (local >= 0).all() and (local < np.asarray(counts)[shard]).all()


@_SETTINGS
@given(counts=counts_st, seed=st.integers(0, 1000), window=st.integers(1, 60))
def test_a_window_reads_a_contiguous_run_of_permuted_shards(counts, seed, window):
    o = EpochOrder(counts, "fp", seed, 3, shuffle_window=window)
    n = sum(counts)
    rank_of_shard = np.empty(len(counts), dtype=np.int64)
    rank_of_shard[o.shard_order] = np.arange(len(counts))
    for k in range(o.num_windows):
        pos = np.arange(k * o.window, min(n, (k + 1) * o.window))
        shard, _ = o.locate(o.ids(pos))
        ranks = np.unique(rank_of_shard[shard])
        # every non-empty shard between the first and last slot touched is touched: the
        # window is one contiguous run of the epoch's shard order
        between = {int(s) for s in o.shard_order[ranks.min() : ranks.max() + 1] if counts[s]}
        assert between == set(shard.tolist())
        assert np.array_equal(np.sort(o.stream_index(pos)), pos)


@_SETTINGS
@given(counts=counts_st, seed=st.integers(0, 1000), window=st.integers(1, 60))
def test_shards_per_window_bounds_what_a_window_touches(counts, seed, window):
    o = EpochOrder(counts, "fp", seed, 1, shuffle_window=window)
    bound = shards_per_window(counts, o.window)
    for k in range(o.num_windows):
        pos = np.arange(k * o.window, min(o.length, (k + 1) * o.window))
        assert len(np.unique(o.locate(o.ids(pos))[0])) <= bound


def test_default_window_mixes_at_least_four_shards():
    counts = [100_000] * 20
    assert default_shuffle_window(counts) == 400_000  # four shards
    o = EpochOrder(counts, "fp", 0, 0)
    first = o.locate(o.ids(np.arange(0, o.window, 97)))[0]
    assert len(np.unique(first)) >= 4
    assert default_shuffle_window([1000] * 30) == 30_000  # small: one window, global shuffle
    assert default_shuffle_window([5000] * 3000) == 1 << 18  # at least 256 Ki samples...
    assert default_shuffle_window([1000] * 3000) == 64_000  # ...or 64 shards
    assert default_shuffle_window([10**7] * 3) == 1 << 22  # at most 4 Mi samples


def test_epochs_seeds_and_fingerprints_change_the_order_and_shard_order():
    counts = [50] * 16
    base = EpochOrder(counts, "fp", 0, 0)
    shard_orders = {tuple(EpochOrder(counts, "fp", 0, e).shard_order) for e in range(6)}
    assert len(shard_orders) == 6  # a new shard permutation every epoch
    for other in (EpochOrder(counts, "fp", 1, 0), EpochOrder(counts, "fp2", 0, 0)):
        assert not np.array_equal(other.ids(np.arange(800)), base.ids(np.arange(800)))
    again = EpochOrder(counts, "fp", 0, 0)
    np.testing.assert_array_equal(again.ids(np.arange(800)), base.ids(np.arange(800)))


def test_no_shuffle_is_manifest_order():
    o = EpochOrder([3, 0, 4], "fp", 0, 5, shuffle=False)
    np.testing.assert_array_equal(o.ids(np.arange(7)), np.arange(7))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="seed=-1"):
        EpochOrder([3], "fp", -1, 0)
    with pytest.raises(ValueError, match="shuffle_window=0"):
        EpochOrder([3], "fp", 0, 0, shuffle_window=0)
    with pytest.raises(IndexError):
        EpochOrder([3], "fp", 0, 0).ids([3])
    with pytest.raises(ValueError, match="last_batch='keep'"):
        Partition(0, 10, 2, last_batch="keep")
    with pytest.raises(ValueError, match="past the end"):
        Partition(11, 10, 2)
    with pytest.raises(ValueError, match="rank=2 world_size=2"):
        Partition(0, 10, 2, rank=2, world_size=2)


# --- partition -----------------------------------------------------------------------------


def _global_run(n: int, start: int, bs: int, world: int, policy: str) -> list[list[int]]:
    """Global steps of one run: per step, the rank batches interleaved back into positions."""
    parts = [Partition(start, n, bs, r, world, policy) for r in range(world)]
    steps: list[list[int]] = []
    for s in range(parts[0].num_steps):
        batches = [p.batch_positions(s).tolist() if s < p.num_batches() else [] for p in parts]
        merged = []
        for j in range(bs):
            merged += [b[j] for b in batches if j < len(b)]
        steps.append(merged)
    return steps


@_SETTINGS
@given(
    n=st.integers(1, 120),
    start_frac=st.floats(0, 1),
    bs=st.integers(1, 9),
    world=st.integers(1, 5),
    policy=st.sampled_from(["pad", "drop", "short"]),
)
@example(n=1, start_frac=1.0, bs=1, world=1, policy="pad")  # resumed at the epoch's end
def test_partition_covers_the_rest_of_the_epoch_exactly(n, start_frac, bs, world, policy):
    start = int(start_frac * n)
    g = bs * world
    steps = _global_run(n, start, bs, world, policy)
    flat = [p for s in steps for p in s]
    rest = list(range(start, n))
    if policy == "short":
        assert flat == rest
    elif policy == "drop":
        assert flat == rest[: (len(rest) // g) * g]
        assert all(len(s) == g for s in steps)
    else:
        # issue 22 round 3 item 1: the padding repeats the positions just before the last
        # step, newest first (the last window's: still cached), not the epoch's first ones
        extra = -len(rest) % g
        last = start + (len(steps) - 1) * g
        assert flat == rest + [(last - 1 - i) % n for i in range(extra)]
        assert all(len(s) == g for s in steps)
        if n >= g and steps:  # no position twice inside one global step (none: nothing left)
            assert len(set(steps[-1])) == g
    parts = [Partition(start, n, bs, r, world, policy) for r in range(world)]
    if policy != "short":
        assert len({p.num_batches() for p in parts}) == 1  # ranks stay in lockstep
    assert parts[0].consumed_after(parts[0].num_steps) == (
        n if policy != "drop" else start + parts[0].num_steps * g
    )


@_SETTINGS
@given(
    n=st.integers(1, 150),
    bs1=st.integers(1, 7),
    w1=st.integers(1, 4),
    bs2=st.integers(1, 7),
    w2=st.integers(1, 4),
    cut=st.floats(0, 1),
)
def test_resume_at_consumed_position_with_another_layout_gives_the_exact_remainder(
    n, bs1, w1, bs2, w2, cut
):
    first = _global_run(n, 0, bs1, w1, "short")
    k = int(cut * len(first))
    consumed = Partition(0, n, bs1, 0, w1, "short").consumed_after(k)
    second = _global_run(n, consumed, bs2, w2, "short")
    seen = [p for s in first[:k] for p in s] + [p for s in second for p in s]
    assert seen == list(range(n))


@_SETTINGS
@given(
    n=st.integers(1, 150),
    bs=st.integers(1, 7),
    world=st.integers(1, 4),
    cut=st.floats(0, 1),
    policy=st.sampled_from(["pad", "drop", "short"]),
)
def test_resume_with_the_same_layout_repeats_the_rest_of_the_run_padding_included(
    n, bs, world, cut, policy
):
    """issue 22 round 3 item 1: resumed at any consumed position - mid-epoch or at the
    padded last step - a run with the same layout makes the very steps the uninterrupted
    run makes from there, padding included."""
    whole = _global_run(n, 0, bs, world, policy)
    k = int(cut * len(whole))
    consumed = Partition(0, n, bs, 0, world, policy).consumed_after(k)
    assert _global_run(n, consumed, bs, world, policy) == whole[k:]


def test_the_padding_reads_the_last_window_not_the_first():
    """issue 22 round 3 item 1: 100,096 positions for 100,000 samples (global batch 256):
    the 96 padded slots repeat positions of the epoch's last window (read moments before,
    their shards still in the node cache), never the epoch's first positions."""
    n, g, window = 100_000, 256, 7_448
    part = Partition(0, n, g)
    pad = part.batch_positions(part.num_steps - 1)[n % g :]
    assert pad.size == g - n % g
    assert pad.min() >= (n - 1) // window * window  # the last window
    assert len(set(pad.tolist()) | set(range(n - n % g, n))) == g  # distinct in its step
    # resumed inside the padded tail (at its step, with two ranks): the same positions
    two = [Partition(n - n % g, n, g // 2, r, 2) for r in range(2)]
    got = sorted(p for r in two for p in r.batch_positions(0).tolist())
    assert got == sorted(part.batch_positions(part.num_steps - 1).tolist())


# --- mixture ---------------------------------------------------------------------------


@_SETTINGS
@given(
    weights=st.lists(st.floats(0.5, 5), min_size=1, max_size=4),
    block=st.integers(256, 512),
    seed=st.integers(0, 100),
    length=st.integers(1, 1500),
)
def test_mixture_follows_the_weights_and_reads_each_source_in_order(weights, block, seed, length):
    m = MixtureOrder(weights, "mix", seed, 2, length, block=block)
    src, off = m.assign(np.arange(length))
    norm = np.asarray(weights) / sum(weights)
    for i in range(len(weights)):
        mine = off[src == i]
        # each source's stream is consumed in order, with no gap and no repeat
        np.testing.assert_array_equal(mine, np.arange(mine.size))
        # at every block boundary the share is within one sample of the weight
        for b in range(1, length // block + 1):
            have = int((src[: b * block] == i).sum())
            assert abs(have - b * block * norm[i]) < 1 + 1e-9
    # a fresh object, scrambled lookups: same answer
    m2 = MixtureOrder(weights, "mix", seed, 2, length, block=block)
    probe = np.random.default_rng(seed).permutation(length)
    s2, o2 = m2.assign(probe)
    np.testing.assert_array_equal(s2, src[probe])
    np.testing.assert_array_equal(o2, off[probe])


def test_mixture_rejects_weights_too_small_for_the_block():
    with pytest.raises(ValueError, match="larger mix block"):
        MixtureOrder([1.0, 1e-5], "mix", 0, 0, 100, block=128)
    with pytest.raises(ValueError, match="positive"):
        MixtureOrder([1.0, 0.0], "mix", 0, 0, 100)


# --- memory --------------------------------------------------------------------------------


def test_order_of_a_hundred_million_samples_is_lazy_and_bounded():
    counts = np.full(100_000, 1_000, dtype=np.int64)  # 10^8 samples in 10^5 shards
    tracemalloc.start()
    try:
        o = EpochOrder(counts, "big", 7, 3)
        assert len(o) == 100_000_000
        probes = np.array([0, 1, 54_321_987, 99_999_999], dtype=np.int64)
        ids = o.ids(probes)
        shard, local = o.locate(ids)
        batch = o.ids(np.arange(77_777_000, 77_777_512))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(set(batch.tolist())) == 512
    assert ((ids >= 0) & (ids < 100_000_000)).all() and (local < 1_000).all()
    assert shard.max() < 100_000
    # materialising the order would take 800 MB; we hold shard tables + one window (~5 MB)
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_mix_seeds_is_mix_seed_for_every_value():
    """The vectorized twin (a batch's transform RNG seed, computed for many batches at once)
    gives mix_seed's numbers exactly: one- and two-word values, zero, any head and tail."""
    rng = np.random.default_rng(4)
    for head, tail in [
        ((0, 3), (0x5EED,)),
        ((2**40, 0, 7), ()),
        ((), (1, 2**63 - 1)),
        ((5,), (0,)),
    ]:
        vals = np.concatenate(
            ([0, 1, 2**32 - 1, 2**32, 2**63 - 1], rng.integers(0, 2**63 - 1, 40))
        ).astype(np.int64)
        assert mix_seeds(head, vals, tail).tolist() == [
            mix_seed(*head, int(v), *tail) for v in vals
        ]
    assert mix_seeds((1,), np.zeros(0, np.int64), ()).size == 0
