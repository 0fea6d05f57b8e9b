"""The dataset's tar read path (mmap + per-shard row table) against ShardReader, for uniform
and mixed sample layouts, and the numpy-backed shard index."""

from __future__ import annotations

import os
from typing import cast

import numpy as np
import pytest
import xxhash

from unbroken.data.prepare.pack import pack
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.tar.reader import ShardError, ShardIndex, ShardReader


def _samples(n: int, layout: str) -> list[dict[str, object]]:
    rng = np.random.default_rng(11)
    out: list[dict[str, object]] = []
    for i in range(n):
        s: dict[str, object] = {"__key__": f"k{i:04d}", "bin": rng.bytes(int(rng.integers(0, 900)))}
        if layout == "three":
            s["json"] = b'{"i": %d}' % i
            s["seg.png"] = rng.bytes(50)
        elif layout == "mixed" and i % 3:
            s["txt" if i % 3 == 1 else "cls"] = str(i).encode()
        out.append(s)
    return out


def _pack(samples: list[dict[str, object]], root: str, shard_size: int = 1 << 20) -> str:
    """``samples`` packed into ``root`` (a mixed layout allowed); the first shard's path."""
    pack(iter(samples), root, shard_size=shard_size, workers=1, fsync=False, progress=False,
         allow_partial=True)  # fmt: skip
    return os.path.join(root, "shard-000000.tar")


@pytest.mark.parametrize("layout", ["one", "three", "mixed"])
def test_dataset_reads_exactly_what_shard_reader_reads(tmp_path, layout):
    want = _samples(120, layout)
    root = str(tmp_path / layout)
    _pack(want, root)
    ds = StreamingDataset(root, seed=3, shuffle_window=50)
    got = ds.read(0, np.arange(ds.epoch_length))
    by_key = {s["__key__"]: s for s in want}
    assert len(got) == 120 and {s["__key__"] for s in got} == set(by_key)
    for s in got:
        assert s == by_key[s["__key__"]]
        assert all(type(v) is bytes for k, v in s.items() if k != "__key__")
    shards = [ds._readers[0]._shard(i) for i in range(len(ds._readers[0].counts))]
    # uniform shards take the row-table path; a mixed layout the general one
    assert all((m._rows is None) == (layout == "mixed") for m in shards)
    reader = shards[0]
    assert shards[0].read_many(np.array([3, 1])) == [reader[3], reader[1]]


def test_a_shard_read_a_few_samples_at_a_time_is_planned_once_the_reads_have_paid(tmp_path):
    """A worker's first batch after its fork reads ~10 samples from each of many shards: no
    row table for them (0.7-1.8 ms each in a fresh worker, measured) until the samples read
    without it pass 1/64 of the shard's samples; the bytes are the same either way."""
    root = str(tmp_path / "d")
    shard = ShardReader(_pack(_samples(1920, "three"), root, shard_size=1 << 30))
    assert shard.index.num_samples == 1920  # one shard: the table is due past 1920 // 64 = 30
    want = ShardReader(shard.path)
    for k, local in enumerate(np.arange(40).reshape(5, 8)[:, ::-1]):
        got = shard.read_many(local)
        assert got == [want[int(i)] for i in local]
        planned = shard._rows is not None
        assert planned == (8 * (k + 1) > 30), f"after {8 * (k + 1)} samples read: {planned}"


def test_index_loads_as_numpy_and_round_trips(tmp_path):
    root = str(tmp_path / "d")
    _pack(_samples(40, "three"), root)
    tar = next(f for f in sorted(os.listdir(root)) if f.endswith(".tar"))
    idx = ShardIndex.load(os.path.join(root, tar + ".idx"))
    assert isinstance(idx.data_offset, np.ndarray) and idx.data_offset.dtype == np.int64
    assert ShardIndex.from_bytes(idx.to_bytes(), source="x") == idx
    built = ShardIndex.from_arrays(
        [idx.key(i).encode() for i in range(idx.num_samples)],
        np.diff(idx.member_start).tolist(),
        [idx.ext(j).encode() for j in range(len(idx.data_offset))],
        idx.data_offset.tolist(),
        cast(np.ndarray, idx.data_size).tolist(),
        idx.tar_bytes,
        idx.tar_checksum,
        idx.member_hash,
    )
    assert built == idx and built != ShardIndex.from_arrays([], [], [], [], [], 0, "0")
    with ShardReader(os.path.join(root, tar)) as r:
        assert [s["__key__"] for s in r] == [f"k{i:04d}" for i in range(40)]
        assert r[-1] == list(r)[-1]
        assert ShardReader(r.path).read_many(np.array([0])) == [r[0]]
    raw = bytearray(idx.to_bytes())
    raw[72 : 72 + 8] = (5).to_bytes(8, "little")  # member_start[0] != 0
    with pytest.raises(ShardError, match="index checksum does not match"):
        ShardIndex.from_bytes(bytes(raw), source="bad.idx")

    def resealed(b: bytearray) -> bytes:  # the damage behind a valid self-checksum
        return bytes(b[:-8]) + xxhash.xxh3_64_intdigest(bytes(b[:-8])).to_bytes(8, "little")

    with pytest.raises(ShardError, match="inconsistent"):
        ShardIndex.from_bytes(resealed(raw), source="bad.idx")
    raw[72 : 72 + 8] = (1 << 63).to_bytes(8, "little")
    with pytest.raises(ShardError, match="2\\*\\*63"):
        ShardIndex.from_bytes(resealed(raw), source="bad.idx")


def _fds_on(root: str) -> int:
    """This process's open descriptors on files under ``root``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(root)
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return n


def test_a_dropped_dataset_leaves_no_shard_open(stream_data):
    """A dataset (and its shard readers) no longer referenced closes its shards: a job or a
    test process that makes many datasets must not collect one descriptor per shard read (the
    suite's workers held >1,000 before; EMFILE in a long-lived process)."""
    import gc

    root = stream_data("tar")
    before = _fds_on(root)
    for _ in range(3):
        ds = StreamingDataset(root, seed=0)
        ds.read(0, np.arange(ds.epoch_length))
        assert _fds_on(root) > before  # the shards are open while it is in use
        del ds
        gc.collect()
    assert _fds_on(root) == before


def test_a_dropped_shard_reader_closes_its_shard(tmp_path):
    root = str(tmp_path / "d")
    shard = _pack(_samples(10, "one"), root)
    r = ShardReader(shard)
    assert r[0]["__key__"] == "k0000" and _fds_on(shard) == 1
    del r
    assert _fds_on(shard) == 0
