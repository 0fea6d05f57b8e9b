"""StreamingDataset and StatefulLoader: content, policies, state semantics, errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections import Counter
from typing import Any, cast

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from datakit import build_tar_dataset, ids_collate, sample_id
from unbroken.data.stream.dataset import Source, StreamingDataset
from unbroken.data.stream.loader import StatefulLoader
from unbroken.data.stream.order import Partition
from unbroken.data.tar.reader import ShardReader
from unbroken.data.tokens.shard import TokenShard

# num_workers=3 on a 2-core runner is deliberate (worker-count changes)
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _epoch_ids(loader: StatefulLoader) -> list[str]:
    return [x for b in loader for x in b]


def test_tar_samples_are_the_packed_bytes(stream_data):
    root = stream_data("tar")
    ds = StreamingDataset(root, seed=1)
    by_key = {}
    for s in ds._readers[0].manifest.shards:
        for smp in ShardReader(os.path.join(root, s.name)):
            by_key[smp["__key__"]] = smp
    got = list(ds)
    assert len(got) == len(by_key) == 203
    for smp in got:
        assert smp == by_key[smp["__key__"]]
    assert [s["__key__"] for s in got] != sorted(by_key)  # shuffled


def test_token_samples_are_windows_of_the_shard(stream_data):
    root = stream_data("tokens")
    ds = StreamingDataset(root, seed=2)
    reader = ds._readers[0]
    seqs = ds.read(0, np.arange(ds.epoch_length))
    _, ids = ds.lookup(0, np.arange(ds.epoch_length))
    shard, local = reader.locate(ids)
    for seq, s, i in zip(seqs, shard.tolist(), local.tolist(), strict=True):
        want = TokenShard(os.path.join(root, reader.manifest.shards[s].name)).sequence(i, 8)
        assert seq.dtype == np.int64 and seq.shape == (9,)
        np.testing.assert_array_equal(seq, want)
    # another seq_len is another dataset: other counts, other fingerprint
    ds16 = StreamingDataset(root, seq_len=16)
    assert ds16.epoch_length < ds.epoch_length
    assert ds16.fingerprint != ds.fingerprint


def test_plain_dataloader_over_the_dataset_is_worker_independent(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=5)
    ref = [sample_id(s) for s in ds]
    got = [sample_id(s) for s in DataLoader(ds, batch_size=None, num_workers=2)]
    assert got == ref and sorted(ref) == sorted(set(ref))
    assert len(ds) == 203


@pytest.mark.parametrize(
    "policy,batches,last_len", [("pad", 21, 10), ("drop", 20, 10), ("short", 21, 3)]
)
def test_last_batch_policies(stream_data, policy, batches, last_len):
    ds = StreamingDataset(stream_data("tar"), seed=0)
    ld = StatefulLoader(ds, batch_size=10, collate_fn=ids_collate, last_batch=policy)
    assert len(ld) == batches
    out = list(ld)
    assert len(out) == batches and len(out[-1]) == last_len
    flat = [x for b in out for x in b]
    order = [sample_id(s) for s in ds.read(0, np.arange(203))]
    if policy == "pad":  # the 7 missing slots repeat the samples just before the last batch
        assert flat == order + order[199:192:-1]  # (issue 22 round 3 item 1)
    elif policy == "drop":
        assert flat == order[:200]
    else:
        assert flat == order
    assert ld.state_dict()["epoch"] == 1 and ld.state_dict()["samples_consumed"] == 0


def test_last_batch_is_the_one_spelling_of_drop_last(stream_data):
    """Issue 24 item 3: one way in - a LoaderConfig and its field names as keywords;
    ``drop_last`` (torch's spelling of one of the three policies) is refused with the fix."""
    ds = StreamingDataset(stream_data("tar"))
    assert StatefulLoader(ds, batch_size=10, last_batch="drop").config.last_batch == "drop"
    with pytest.raises(TypeError, match="drop_last=True is last_batch='drop'"):
        StatefulLoader(ds, batch_size=10, drop_last=True)
    with pytest.raises(TypeError, match=r"bogus; its options are .*batch_size, last_batch"):
        StatefulLoader(ds, bogus=1)
    with pytest.raises(TypeError, match="takes a LoaderConfig, got int"):
        StatefulLoader(ds, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="persistent_workers=True needs num_workers"):
        StatefulLoader(ds, batch_size=10, persistent_workers=True)
    with pytest.raises(TypeError, match="needs a StreamingDataset"):
        StatefulLoader([1, 2, 3], batch_size=1)  # type: ignore[arg-type]
    # torch's DataLoader spellings of the order: named, with where the order is chosen
    for kw in ({"shuffle": True}, {"sampler": None}, {"batch_sampler": None}):
        with pytest.raises(
            TypeError, match=rf"takes no {next(iter(kw))}: the order is the dataset's"
        ):
            StatefulLoader(ds, batch_size=10, **kw)
    with pytest.raises(ValueError, match="timeout=5 needs num_workers > 0"):  # torch asserted
        StatefulLoader(ds, batch_size=10, timeout=5)


def test_state_counts_delivered_batches_not_prefetched_ones(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=3, rank=1, world_size=2)
    ld = StatefulLoader(ds, batch_size=4, collate_fn=ids_collate, num_workers=2, prefetch_factor=4)
    it = iter(ld)
    next(it)
    time.sleep(0.3)  # let the workers run ahead
    assert ld.state_dict()["samples_consumed"] == 8  # one global step of 2 ranks x 4
    next(it), next(it)
    sd = ld.state_dict()
    assert sd["samples_consumed"] == 24 and sd["epoch"] == 0
    assert json.loads(json.dumps(sd)) == sd
    it.close()  # type: ignore[attr-defined]
    assert ld.state_dict() == sd  # abandoning the iterator keeps the delivered position


def _augment(sample: dict) -> tuple[str, float, float, float]:
    """A random augmentation drawing from python's, numpy's and torch's global RNGs."""
    return sample["__key__"], random.random(), float(np.random.rand()), float(torch.rand(()))


def _numpy_key() -> np.ndarray:
    """numpy's global RNG key: get_state() returns the legacy tuple (its stub says a dict)."""
    return cast("tuple[Any, ...]", np.random.get_state())[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_leaves_the_global_rngs_alone(stream_data, workers):
    """A resumed run opens one DataLoader iterator more than the uninterrupted run (at the
    resume point); if iterators drew their worker seed from the global RNG, the model's
    dropout stream would shift by one draw after every resume. Transforms running in this
    process (num_workers=0) must not move the training RNGs either."""
    ds = StreamingDataset(stream_data("tar"), seed=3, transform=_augment)
    ld = StatefulLoader(ds, batch_size=8, collate_fn=list, num_workers=workers)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    before = (torch.get_rng_state(), random.getstate(), _numpy_key().copy())
    it = iter(ld)
    next(it)
    it.close()  # type: ignore[attr-defined]
    next(iter(ld))  # a second iterator, as after a resume
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(_numpy_key(), before[2])


def test_random_augmentations_resume_exactly_for_any_worker_count(stream_data):
    """Transform randomness is seeded per read from (seed, epoch, position): an interrupted
    run resumed with another num_workers draws exactly the augmentations of the
    uninterrupted run, sample for sample."""
    root = stream_data("tar")

    def loader(workers: int) -> StatefulLoader:
        ds = StreamingDataset(root, seed=3, transform=_augment)
        return StatefulLoader(ds, batch_size=8, collate_fn=list, num_workers=workers)

    ref = loader(0)
    full = list(ref) + list(ref)  # epochs 0 and 1
    assert list(loader(2)) == full[: len(full) // 2]
    first = loader(2)
    it = iter(first)
    head = [next(it) for _ in range(7)]
    state = first.state_dict()
    it.close()  # type: ignore[attr-defined]
    resumed = loader(3)
    resumed.load_state_dict(state)
    tail = list(resumed) + list(resumed)  # rest of epoch 0, then epoch 1
    assert head + tail == full
    draws = [x[1] for b in full for x in b]
    assert len(set(draws)) == len(draws)  # and they are random, not one repeated value


def test_resume_reads_only_the_samples_it_yields(stream_data):
    """O(1) resume: no replay - the first batch after resume at 10% or 90% reads one batch."""
    reads: Counter[str] = Counter()

    def counting(sample):
        reads["n"] += 1
        return sample

    root = stream_data("tar")
    for frac in (0.1, 0.9):
        reads.clear()
        ds = StreamingDataset(root, seed=4, transform=counting)
        ld = StatefulLoader(ds, batch_size=5, collate_fn=ids_collate)
        state = {**ld.state_dict(), "samples_consumed": int(frac * 203)}
        t0 = time.perf_counter()
        ld.load_state_dict(state)
        first = next(iter(ld))
        elapsed = time.perf_counter() - t0
        assert reads["n"] == 5
        order = [sample_id(s) for s in StreamingDataset(root, seed=4).read(0, np.arange(203))]
        assert first == order[int(frac * 203) : int(frac * 203) + 5]
        assert elapsed < 1.0  # the benchmark measures this properly; here: no replay


def test_changed_dataset_is_refused_or_restarts_the_epoch(stream_data, tmp_path):
    src = stream_data("tar_b")
    root = str(tmp_path / "ds")
    shutil.copytree(src, root)
    ld = StatefulLoader(StreamingDataset(root, seed=0), batch_size=4, collate_fn=ids_collate)
    ld.set_epoch(2)
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    old_fp = state["fingerprint"]
    shutil.rmtree(root)
    build_tar_dataset(root, 62, prefix="b")  # one more sample: another dataset
    ds2 = StreamingDataset(root, seed=0)
    with pytest.raises(ValueError) as ei:
        StatefulLoader(ds2, batch_size=4).load_state_dict(state)
    msg = str(ei.value)
    assert old_fp in msg and ds2.fingerprint in msg and "on_dataset_change='restart_epoch'" in msg
    ld2 = StatefulLoader(
        ds2, batch_size=4, collate_fn=ids_collate, on_dataset_change="restart_epoch"
    )
    ld2.load_state_dict(state)
    assert (ld2.epoch, ld2.samples_consumed) == (2, 0)
    first = next(iter(ld2))
    assert first == [sample_id(s) for s in ds2.read(2, np.arange(4))]


def test_other_state_mismatches_are_named(stream_data):
    root = stream_data("tar")
    sd = StatefulLoader(StreamingDataset(root, seed=1), batch_size=4).state_dict()
    with pytest.raises(
        ValueError, match=r"seed=1 .* seed=2; construct StreamingDataset\(\.\.\., seed=1\)"
    ):
        StatefulLoader(StreamingDataset(root, seed=2), batch_size=4).load_state_dict(sd)
    with pytest.raises(ValueError, match="shuffle_window=.*pass StreamingDataset"):
        StatefulLoader(
            StreamingDataset(root, seed=1, shuffle_window=7), batch_size=4
        ).load_state_dict(sd)
    with pytest.raises(ValueError, match="missing or bad field"):
        StatefulLoader(StreamingDataset(root, seed=1), batch_size=4).load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="outside this dataset's epoch"):
        StatefulLoader(StreamingDataset(root, seed=1), batch_size=4).load_state_dict(
            {**sd, "samples_consumed": 10_000}
        )


def test_epochs_set_epoch_and_automatic_advance(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=9)
    ld = StatefulLoader(ds, batch_size=16, collate_fn=ids_collate, last_batch="short")
    e0, e1 = _epoch_ids(ld), _epoch_ids(ld)  # automatic: epoch 0 then epoch 1
    assert ld.epoch == 2 and sorted(e0) == sorted(e1) and e0 != e1
    ld.set_epoch(1)
    assert _epoch_ids(ld) == e1
    it = iter(ld)  # epoch 2, interrupted after one batch
    first = next(it)
    ld.set_epoch(2)  # same epoch: a resume, keeps the position
    assert ld.samples_consumed == 16
    it.close()  # type: ignore[attr-defined]
    assert first + _epoch_ids(ld) == [sample_id(s) for s in ds.read(2, np.arange(203))]
    with pytest.raises(ValueError, match="epoch=-1"):
        ld.set_epoch(-1)


def test_persistent_workers_match_fresh_workers_across_epochs_and_breaks(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=6)
    ref = StatefulLoader(ds, batch_size=8, collate_fn=ids_collate, last_batch="short")
    want = [_epoch_ids(ref) for _ in range(3)]
    ld = StatefulLoader(
        ds,
        batch_size=8,
        collate_fn=ids_collate,
        last_batch="short",
        num_workers=2,
        persistent_workers=True,
    )
    assert _epoch_ids(ld) == want[0]
    dl = ld._dl
    assert _epoch_ids(ld) == want[1]
    assert ld._dl is dl  # the workers were kept across a complete epoch
    it = iter(ld)
    part = [x for _, b in zip(range(3), it, strict=False) for x in b]
    it.close()  # type: ignore[attr-defined]
    assert part + _epoch_ids(ld) == want[2]  # a break mid-epoch: workers rebuilt, no replay


def test_mixture_follows_weights_and_refreshes_an_exhausted_source(stream_data):
    a, b = stream_data("tar"), stream_data("tar_b")
    ds = StreamingDataset([Source(a, 0.7), Source(b, 0.3)], seed=0, mix_block=64)
    assert ds.epoch_length == 264
    ids = [sample_id(s) for s in ds.read(0, np.arange(264))]
    bs = [i for i in ids if i.startswith("b")]
    # exact at every block boundary (the last, partial block is a random part of a block)
    assert abs(sum(i.startswith("b") for i in ids[:256]) - 0.3 * 256) < 1
    assert sorted(bs[:61]) == sorted(set(bs[:61])) and len(set(bs[:61])) == 61
    assert len(set(bs[61:])) == len(bs[61:])  # second pass over b: fresh, no repeat inside
    assert ids == [sample_id(s) for s in ds.read(0, np.arange(264))]
    ds2 = StreamingDataset([Source(a, 0.5), Source(b, 0.5)], seed=0, mix_block=64)
    assert ds2.fingerprint != ds.fingerprint  # weights are part of what a position means
    sd = StatefulLoader(ds, batch_size=4).state_dict()
    assert [s["weight"] for s in sd["sources"]] == pytest.approx([0.7, 0.3])


def test_shards_are_dealt_to_workers_afresh_every_epoch(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=0)
    reader = ds._readers[0]

    def shards_of_worker0(epoch):
        part = Partition(0, ds.epoch_length, 8)
        pos = np.concatenate([part.batch_positions(b) for b in range(0, part.num_batches(), 2)])
        _, ids = ds.lookup(epoch, pos)
        return set(reader.locate(ids)[0].tolist())

    seen = [shards_of_worker0(e) for e in range(3)]
    assert seen[0] != seen[1] and seen[1] != seen[2]


def test_bad_inputs_name_the_fix(stream_data):
    with pytest.raises(ValueError, match="unbroken data stage"):
        StreamingDataset("s3://bucket/data")
    with pytest.raises(ValueError, match="token datasets only"):
        StreamingDataset(Source(stream_data("tar"), seq_len=8))
    with pytest.raises(ValueError, match="pass both or neither"):
        StreamingDataset(stream_data("tar"), rank=1)
    with pytest.raises(ValueError, match="samples_per_epoch applies to mixtures"):
        StreamingDataset(stream_data("tar"), samples_per_epoch=5)
    with pytest.raises(FileNotFoundError, match="no dataset manifest"):
        StreamingDataset("/nonexistent/dir")

    def broken(sample):
        raise KeyError("jpg")

    ds = StreamingDataset(stream_data("tar"), transform=broken)
    with pytest.raises(RuntimeError, match=r"transform 'broken' failed on sample 's\d{5}'"):
        next(iter(ds))


def test_token_batches_are_long_tensors_like_default_collate(stream_data):
    import torch
    from torch.utils.data import default_collate

    ds = StreamingDataset(stream_data("tokens"), seed=1)
    fast = list(StatefulLoader(ds, batch_size=4, num_workers=2))
    ref = list(StatefulLoader(ds, batch_size=4, collate_fn=default_collate))
    assert len(fast) == len(ref) == len(StatefulLoader(ds, batch_size=4))
    for a, b in zip(fast, ref, strict=True):
        assert isinstance(a, torch.Tensor) and a.dtype == torch.int64 and a.shape == (4, 9)
        assert torch.equal(a, b)


@pytest.mark.slow  # issue 24 item 10: out of `make unit`, still in `make test`
def test_dataset_over_a_synthetic_hundred_million_sample_manifest_is_lazy(tmp_path):
    """10^4 shards x 10^4 samples, no shard files: building the dataset and looking up a
    batch at 90% of an epoch touches only shard tables and one window."""
    import tracemalloc

    from unbroken.data.manifest import DatasetManifest, ShardInfo

    shards = [
        ShardInfo(
            f"shard-{i:06d}.tar", 10_000, 1 << 26, "0" * 32, f"shard-{i:06d}.tar.idx", 1, "0" * 32
        )
        for i in range(10_000)
    ]
    DatasetManifest.create("tar", shards).save(str(tmp_path))
    tracemalloc.start()
    try:
        ds = StreamingDataset(str(tmp_path), seed=1, rank=3, world_size=8)
        part = ds.partition(90_000_000, 64)
        src, ids = ds.lookup(5, part.batch_positions(0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ds.epoch_length == 100_000_000 and len(set(ids.tolist())) == 64
    assert ds.shuffle_window == [1 << 18]
    assert peak < 48 * 2**20, f"peak {peak / 2**20:.1f} MiB"  # the order itself would be 800 MB
