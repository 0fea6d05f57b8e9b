"""Tar shards, their offset index, the reader and dataset.json: round trips, interoperability
with webdataset, and every kind of damage a shard or index can suffer."""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.data.manifest import DatasetManifest, ManifestError, ShardInfo
from unbroken.data.prepare.pack import index_directory, pack
from unbroken.data.tar.reader import (
    ShardError,
    ShardIndex,
    ShardReader,
    index_tar,
    verify_shard,
)
from unbroken.data.tar.writer import TarShardWriter, tar_header


def _samples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "__key__": f"k{i:05d}",
            "bin": rng.bytes(int(rng.integers(0, 3000))),
            "json": json.dumps({"i": i}).encode(),
        }
        for i in range(n)
    ]


def _write(path: str, samples: list[dict[str, object]]) -> None:
    with TarShardWriter(path, fsync=False) as w:
        for s in samples:
            w.add(str(s["__key__"]), [(k, v) for k, v in s.items() if k != "__key__"])
        w.commit()


def _read_all(root: str) -> list[dict[str, object]]:
    m = DatasetManifest.load(root)
    out: list[dict[str, object]] = []
    for i in range(len(m.shards)):
        with ShardReader(m.shard_path(root, i)) as r:
            out += list(r)
    return out


@pytest.mark.parametrize("name", ["a.b", "dir/sub/0001.seg.png", "x" * 97 + ".js"])
def test_tar_header_is_byte_equal_to_tarfile_ustar(name: str) -> None:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime, ti.uname, ti.gname = 12345, 0o644, 0, "", ""
    assert tar_header(name, 12345) == ti.tobuf(format=tarfile.USTAR_FORMAT)


def test_whole_shard_is_byte_equal_to_tarfile_output(tmp_path: str) -> None:
    """The vectorized header path must produce exactly what tarfile writes (ustar, mtime 0)."""
    samples = _samples(50) + [{"__key__": "d/" + "n" * 94, "bin": b"x" * 513}]  # 100-byte name
    ours = os.path.join(tmp_path, "ours.tar")
    _write(ours, samples)
    ref = io.BytesIO()
    with tarfile.open(fileobj=ref, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for s in samples:
            for ext in ("bin", "json"):
                if ext in s:
                    ti = tarfile.TarInfo(f"{s['__key__']}.{ext}")
                    ti.size, ti.mode, ti.mtime, ti.uname, ti.gname = len(s[ext]), 0o644, 0, "", ""
                    tf.addfile(ti, io.BytesIO(s[ext]))
    assert open(ours, "rb").read() == ref.getvalue()


@pytest.mark.parametrize("size", [0, 1, 9216, 9728, 10240])
def test_archive_end_padding_is_a_whole_record(tmp_path: str, size: int) -> None:
    """9216 bytes of data leave the longest tail (2 zero blocks + 19 blocks of padding)."""
    p = os.path.join(tmp_path, "s.tar")
    _write(p, [{"__key__": "k", "bin": b"\x01" * size}])
    assert os.path.getsize(p) % 10240 == 0
    assert ShardReader(p)[0]["bin"] == b"\x01" * size
    with tarfile.open(p) as tf:
        assert tf.extractfile("k.bin").read() == b"\x01" * size  # type: ignore[union-attr]


def test_long_member_names_fall_back_to_pax_and_stay_readable(tmp_path: str) -> None:
    key = "d/" + "long" * 40  # > 100 bytes: needs a PAX header
    p = os.path.join(tmp_path, "s.tar")
    _write(p, [{"__key__": key, "txt": b"hello", "json": b"{}"}])
    with tarfile.open(p) as tf:
        assert tf.getnames() == [f"{key}.txt", f"{key}.json"]
        assert tf.extractfile(f"{key}.txt").read() == b"hello"  # type: ignore[union-attr]
    assert ShardReader(p)[0] == {"__key__": key, "txt": b"hello", "json": b"{}"}


def test_pack_round_trip_sequential_and_random_access(tmp_path: str) -> None:
    samples = _samples(300)
    res = pack(samples, str(tmp_path), shard_size=60_000, fsync=False, progress=False)
    m = res.manifest
    assert len(m.shards) > 5 and m.num_samples == 300
    assert _read_all(str(tmp_path)) == samples  # in order, byte-identical
    readers = [ShardReader(m.shard_path(str(tmp_path), i)) for i in range(len(m.shards))]
    flat = [(r, j) for r in readers for j in range(len(r))]
    order = list(range(len(flat)))
    random.Random(1).shuffle(order)
    for g in order:
        r, j = flat[g]
        assert r[j] == samples[g]
    assert readers[0][-1] == readers[0][len(readers[0]) - 1]
    with pytest.raises(IndexError):
        readers[0][len(readers[0])]
    for r in readers:
        r.verify()
        r.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.lists(st.integers(0, 1500), min_size=1, max_size=3), min_size=1, max_size=20)
)
def test_round_trip_property(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[list[int]]
) -> None:
    d = str(tmp_path_factory.mktemp("prop"))
    rng = np.random.default_rng(len(sizes))
    samples = [
        {"__key__": f"s{i}", **{f"m{j}": rng.bytes(n) for j, n in enumerate(ms)}}
        for i, ms in enumerate(sizes)
    ]
    pack(samples, d, shard_size=10_240 * 2, fsync=False, progress=False, allow_partial=True)
    assert _read_all(d) == samples


def test_webdataset_reads_our_shards(tmp_path: str) -> None:
    wds = pytest.importorskip("webdataset")
    samples = _samples(120)
    m = pack(samples, str(tmp_path), shard_size=60_000, fsync=False, progress=False).manifest
    urls = [m.shard_path(str(tmp_path), i) for i in range(len(m.shards))]
    got = list(wds.WebDataset(urls, shardshuffle=False))
    assert [g["__key__"] for g in got] == [s["__key__"] for s in samples]
    assert all(
        g["bin"] == s["bin"] and g["json"] == s["json"] for g, s in zip(got, samples, strict=True)
    )


def test_we_index_and_read_webdataset_shardwriter_output(tmp_path: str) -> None:
    wds = pytest.importorskip("webdataset")
    samples = _samples(150, seed=3)
    with wds.ShardWriter(os.path.join(tmp_path, "w-%04d.tar"), maxcount=40, verbose=0) as sw:
        for s in samples:
            sw.write(s)
    res = index_directory(str(tmp_path), workers=1)
    assert res.manifest.num_samples == 150 and len(res.manifest.shards) == 4
    got = _read_all(str(tmp_path))
    assert [g["__key__"] for g in got] == [s["__key__"] for s in samples]
    assert all(
        g["bin"] == s["bin"] and g["json"] == s["json"] for g, s in zip(got, samples, strict=True)
    )
    with ShardReader(os.path.join(tmp_path, "w-0002.tar")) as r:  # random access, foreign shard
        assert r[7]["bin"] == samples[87]["bin"]


def test_reader_without_index_scans_the_tar(tmp_path: str) -> None:
    p = os.path.join(tmp_path, "s.tar")
    _write(p, _samples(10))
    os.unlink(p + ".idx")
    assert ShardReader(p)[9]["__key__"] == "k00009"


def test_index_of_another_shard_is_rejected(tmp_path: str) -> None:
    a, b = os.path.join(tmp_path, "a.tar"), os.path.join(tmp_path, "b.tar")
    _write(a, _samples(20, seed=1))
    _write(b, _samples(20, seed=2))
    with pytest.raises(ShardError, match=r"b\.tar.*a\.tar\.idx"):
        ShardReader(b, a + ".idx")
    # Same size, different layout (member sizes swapped): the member-header check catches it.
    c, d = os.path.join(tmp_path, "c.tar"), os.path.join(tmp_path, "d.tar")
    _write(c, [{"__key__": "x", "bin": b"1" * 1000}, {"__key__": "y", "bin": b"2" * 2000}])
    _write(d, [{"__key__": "x", "bin": b"1" * 2000}, {"__key__": "y", "bin": b"2" * 1000}])
    assert os.path.getsize(c) == os.path.getsize(d)
    with pytest.raises(ShardError, match=r"d\.tar: member x\.bin is not where the index"):
        ShardReader(d, c + ".idx")
    with pytest.raises(ShardError, match="does not match its index"):
        verify_shard(b, a + ".idx")


def test_truncated_or_garbage_index(tmp_path: str) -> None:
    p = os.path.join(tmp_path, "s.tar")
    _write(p, _samples(20))
    raw = open(p + ".idx", "rb").read()
    open(p + ".idx", "wb").write(raw[:-5])
    with pytest.raises(ShardError, match=r"s\.tar\.idx.*truncated"):
        ShardReader(p)
    open(p + ".idx", "wb").write(b"garbage" * 20)
    with pytest.raises(ShardError, match="not an unbroken shard index"):
        ShardReader(p)


@pytest.mark.parametrize("cut", ["mid_member", "member_boundary"])
def test_truncated_tar(tmp_path: str, cut: str) -> None:
    p = os.path.join(tmp_path, "s.tar")
    _write(p, _samples(20))
    idx = ShardIndex.load(p + ".idx")
    end = idx.data_offset[-1] + idx.data_size[-1]
    size = idx.data_offset[-1] + 10 if cut == "mid_member" else end + (-end % 512)
    with open(p, "r+b") as f:
        f.truncate(size)
    with pytest.raises(ShardError, match=r"s\.tar.*truncated"):
        index_tar(p)
    with pytest.raises(ShardError, match=r"s\.tar.*truncated"):
        ShardReader(p)  # with its (now stale) index


def test_corrupt_header_and_bit_flipped_data(tmp_path: str) -> None:
    p = os.path.join(tmp_path, "s.tar")
    _write(p, _samples(20))
    idx = ShardIndex.load(p + ".idx")
    good = open(p, "rb").read()
    bad = bytearray(good)
    bad[idx.data_offset[4] - 512 + 130] ^= 0x55  # inside member 4's header size field
    open(p, "wb").write(bad)
    with pytest.raises(ShardError, match=r"s\.tar: .*corrupt"):
        index_tar(p)
    bad = bytearray(good)
    bad[idx.data_offset[6] + 3] ^= 0x01  # one data bit
    open(p, "wb").write(bad)
    r = ShardReader(p)  # offsets still line up: only a checksum can tell
    with pytest.raises(ShardError, match="damaged"):
        r.verify()
    with pytest.raises(ShardError, match="does not match its index"):
        verify_shard(p)


def test_duplicate_extension_in_foreign_tar(tmp_path: str) -> None:
    p = os.path.join(tmp_path, "dup.tar")
    with tarfile.open(p, "w") as tf:
        for name in ("a.txt", "a.txt"):
            ti = tarfile.TarInfo(name)
            ti.size = 1
            tf.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(ShardError, match=r"dup\.tar: sample 'a' has extension 'txt' twice"):
        index_tar(p)


def test_compressed_tar_is_refused(tmp_path: str) -> None:
    p = os.path.join(tmp_path, "c.tar")
    with tarfile.open(p, "w:gz") as tf:
        ti = tarfile.TarInfo("a.txt")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(ShardError, match=r"c\.tar: corrupt, truncated or compressed"):
        index_tar(p)


# --- dataset.json ----------------------------------------------------------------------------


def _info(name: str, checksum: str = "0" * 32, samples: int = 3) -> ShardInfo:
    return ShardInfo(name, samples, 100, checksum, name + ".idx", 10, "1" * 32)


def test_manifest_round_trip_and_fingerprint(tmp_path: str) -> None:
    m = DatasetManifest.create("tar", [_info("a.tar"), _info("b.tar")])
    m.save(str(tmp_path))
    assert DatasetManifest.load(str(tmp_path)) == m
    assert DatasetManifest.load(os.path.join(tmp_path, "dataset.json")) == m
    d = json.load(open(os.path.join(tmp_path, "dataset.json")))
    assert d["format"] == "unbroken-dataset" and d["version"] == 2 and d["num_samples"] == 6
    changed = DatasetManifest.create("tar", [_info("a.tar"), _info("b.tar", "f" * 32)])
    reordered = DatasetManifest.create("tar", [_info("b.tar"), _info("a.tar")])
    fewer = DatasetManifest.create("tar", [_info("a.tar"), _info("b.tar", samples=2)])
    assert len({m.fingerprint, changed.fingerprint, reordered.fingerprint, fewer.fingerprint}) == 4
    t = DatasetManifest.create("tokens", [_info("t.bin")], dtype="uint16", eos_id=0, seq_len=8)
    t2 = DatasetManifest.create("tokens", [_info("t.bin")], dtype="uint16", eos_id=0, seq_len=16)
    assert t.fingerprint != t2.fingerprint
    t.save(str(tmp_path))
    assert DatasetManifest.load(str(tmp_path)).seq_len == 8


def test_manifest_errors_name_the_file(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "dataset.json")
    with pytest.raises(FileNotFoundError, match="dataset.json: no dataset manifest"):
        DatasetManifest.load(str(tmp_path))
    open(path, "w").write("{not json")
    with pytest.raises(ManifestError, match=r"dataset\.json: malformed JSON"):
        DatasetManifest.load(str(tmp_path))
    d = DatasetManifest.create("tar", [_info("a.tar")]).to_json()
    open(path, "w").write(json.dumps({**d, "version": 99}))
    with pytest.raises(ManifestError, match=r"dataset\.json: manifest version 99 is not supported"):
        DatasetManifest.load(str(tmp_path))
    d["shards"][0]["checksum"] = "e" * 32  # edited without recomputing the fingerprint
    open(path, "w").write(json.dumps(d))
    with pytest.raises(ManifestError, match="fingerprint .* does not match"):
        DatasetManifest.load(str(tmp_path))
    with pytest.raises(ManifestError, match="num_samples"):
        DatasetManifest("tar", (_info("a.tar"),), "x", 5)
