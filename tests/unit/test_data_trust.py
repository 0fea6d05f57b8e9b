"""T-NO-WRONG-BYTE on the data side: every sample byte is verified on read (tar members against
the per-member checksums of the ``.idx``, token blocks against the per-block checksums of the
token index, each index against ``dataset.json``), damage is an error naming dataset, shard,
sample and member (or, with ``on_corrupt="skip"``, skipped and counted), and indexes written
by older versions still read with one warning. Issue 12, items 10 and 12."""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import numpy as np
import pytest

from datakit import build_tar_dataset, build_token_dataset, ids_collate, sample_id
from unbroken.common.fs import checksum_bytes
from unbroken.data.manifest import DatasetManifest
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.stream.loader import StatefulLoader
from unbroken.data.tar.reader import CorruptSampleError, ShardError, ShardIndex, ShardReader
from unbroken.data.tokens.shard import TokenShard

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _flip(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def _all(ds: StreamingDataset) -> list[dict[str, Any]]:
    return ds.read(0, np.arange(ds.epoch_length))


def _member(root: str, shard: int, sample: int, ext: str) -> tuple[str, str, int]:
    """(tar path, key, data offset) of one member, from the (trusted, fresh) index."""
    m = DatasetManifest.load(root)
    tar = os.path.join(root, m.shards[shard].name)
    idx = ShardIndex.load(tar + ".idx")
    for j in range(int(idx.member_start[sample]), int(idx.member_start[sample + 1])):
        if idx.ext(j) == ext:
            return tar, idx.key(sample), int(idx.data_offset[j])
    raise KeyError(ext)


def test_a_flipped_payload_bit_is_an_error_naming_dataset_shard_key_and_member(
    stream_data, tmp_path
):
    root = _copy(stream_data("tar"), str(tmp_path / "ds"))
    tar, key, off = _member(root, 3, 1, "bin")
    _flip(tar, off + 17, 5)
    ds = StreamingDataset(root, seed=0)
    with pytest.raises(CorruptSampleError) as ei:
        _all(ds)
    msg = str(ei.value)
    assert root in msg and os.path.basename(tar) in msg and repr(key) in msg and "'bin'" in msg
    # ShardReader (random access and iteration) refuses it as well
    with ShardReader(tar) as r:
        with pytest.raises(CorruptSampleError, match=repr(key)):
            r[1]
        with pytest.raises(CorruptSampleError, match=repr(key)):
            list(r)


def test_skip_mode_drops_and_counts_the_damaged_sample(stream_data, tmp_path, caplog):
    root = _copy(stream_data("tar"), str(tmp_path / "ds"))
    ref = {sample_id(s): s for s in _all(StreamingDataset(root, seed=0))}
    tar, key, off = _member(root, 5, 0, "cls")
    _flip(tar, off)
    for workers in (0, 2):
        ds = StreamingDataset(root, seed=0, on_corrupt="skip")
        ld = StatefulLoader(
            ds, batch_size=8, collate_fn=list, last_batch="short", num_workers=workers
        )
        with caplog.at_level(logging.WARNING, logger="unbroken.data"):
            got = [s for b in ld for s in b]
        assert len(got) == len(ref) - 1 and key not in {s["__key__"] for s in got}
        assert all(s == ref[s["__key__"]] for s in got)
        assert ld.stats()["corrupt_skipped"] == 1
    assert any(key in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="on_corrupt='bogus' is not one of"):
        StreamingDataset(root, on_corrupt="bogus")


def test_skip_mode_keeps_each_id_with_its_sample(stream_data, tmp_path):
    root = _copy(stream_data("tar"), str(tmp_path / "ds"))
    ref = {s["__key__"]: s["__id__"] for s in _all(StreamingDataset(root, seed=0, with_ids=True))}
    tar, key, off = _member(root, 1, 2, "bin")
    _flip(tar, off)
    got = _all(StreamingDataset(root, seed=0, with_ids=True, on_corrupt="skip"))
    assert len(got) == len(ref) - 1 and key not in {s["__key__"] for s in got}
    assert all(s["__id__"] == ref[s["__key__"]] for s in got)


def test_verify_false_reads_without_checking(stream_data, tmp_path):
    root = _copy(stream_data("tar"), str(tmp_path / "ds"))
    tar, key, off = _member(root, 2, 0, "bin")
    _flip(tar, off)
    ref = {s["__key__"]: s for s in _all(StreamingDataset(stream_data("tar")))}
    got = {s["__key__"]: s for s in _all(StreamingDataset(root, verify=False))}
    assert len(got) == 203 and got[key]["bin"] != ref[key]["bin"]


def test_a_changed_offset_in_an_index_is_refused_by_the_manifest_checksum(stream_data, tmp_path):
    root = _copy(stream_data("tar"), str(tmp_path / "ds"))
    m = DatasetManifest.load(root)
    idx_path = os.path.join(root, m.shards[4].index)
    idx = ShardIndex.load(idx_path)
    raw = bytearray(open(idx_path, "rb").read())
    # data_offset[1] lies after header, member_start[N+1], key_off[N+1] and data_offset[0]
    n = idx.num_samples
    pos = 72 + 8 * (2 * (n + 1) + 1)
    raw[pos : pos + 8] = (int(idx.data_offset[1]) + 512).to_bytes(8, "little")
    with open(idx_path, "wb") as f:
        f.write(raw)
    with pytest.raises(ShardError) as ei:
        _all(StreamingDataset(root, seed=0))
    assert m.shards[4].index in str(ei.value) and root in str(ei.value)


def test_index_not_matching_dataset_json_is_refused(stream_data, tmp_path):
    """An index that is internally consistent but not the one dataset.json recorded is
    refused by the manifest's index checksum (a dataset.json re-fingerprinted after the edit:
    without that, the fingerprint, which covers the index checksums since issue 20, refuses
    the edited file first)."""
    from unbroken.data.manifest import ShardInfo

    root = _copy(stream_data("tar"), str(tmp_path / "ds"))
    m = DatasetManifest.load(root)
    d = json.load(open(os.path.join(root, "dataset.json")))
    d["shards"][1]["index_checksum"] = "0" * 32
    DatasetManifest.create("tar", [ShardInfo.from_json(s) for s in d["shards"]]).save(root)
    with pytest.raises(ShardError, match=m.shards[1].index):
        _all(StreamingDataset(root, seed=0))


def _downgrade_tar_index(path: str) -> bytes:
    """Rewrite a current index in the format-1 layout (no checksums), as older unbroken
    wrote it; returns the new bytes."""
    idx = ShardIndex.load(path)
    v1 = ShardIndex(
        idx.member_start,
        idx.key_off,
        idx.data_offset,
        idx.data_size,
        idx.ext_off,
        idx.strings,
        idx.tar_bytes,
        idx.tar_checksum,
    ).to_bytes()
    with open(path, "wb") as f:
        f.write(v1)
    return v1


def test_indexes_without_checksums_still_read_with_one_warning(stream_data, tmp_path, caplog):
    from unbroken.data.manifest import ShardInfo

    root = _copy(stream_data("tar"), str(tmp_path / "ds"))
    want = {s["__key__"]: s for s in _all(StreamingDataset(root, seed=3))}
    d = json.load(open(os.path.join(root, "dataset.json")))
    for s in d["shards"]:
        raw = _downgrade_tar_index(os.path.join(root, s["index"]))
        assert raw[:8] == b"UBIDX\x01\x00\x00"
        s["index_bytes"], s["index_checksum"] = len(raw), checksum_bytes(raw)
    # new index bytes: another fingerprint (issue 20 item 9), so another order
    DatasetManifest.create("tar", [ShardInfo.from_json(s) for s in d["shards"]]).save(root)
    with caplog.at_level(logging.WARNING, logger="unbroken.data"):
        ds = StreamingDataset(root, seed=3)
        got = {s["__key__"]: s for s in _all(ds)}
    assert got == want
    warn = [r for r in caplog.records if "unverified" in r.getMessage()]
    assert len(warn) == 1 and root in warn[0].getMessage()


def test_token_block_damage_is_named_and_skippable(tmp_path):
    root = build_token_dataset(str(tmp_path / "t"), 3, 200_000, seq_len=512)
    ref = _all(StreamingDataset(root, seed=0))
    m = DatasetManifest.load(root)
    path = os.path.join(root, m.shards[1].name)
    _flip(path, 4 * 70_000 + 1, 3)  # token 70,000: block 1 of shard 1
    with pytest.raises(CorruptSampleError) as ei:
        _all(StreamingDataset(root, seed=0))
    msg = str(ei.value)
    assert root in msg and m.shards[1].name in msg and "block 1" in msg
    ts = TokenShard(path)
    with pytest.raises(CorruptSampleError, match="block 1"):
        ts.sequence(70_000 // 512, 512)
    assert ts.sequence(0, 512).tolist() == TokenShard(path, verify=False).sequence(0, 512).tolist()
    ds = StreamingDataset(root, seed=0, on_corrupt="skip")
    ld = StatefulLoader(ds, batch_size=16, collate_fn=ids_collate, last_batch="short")
    got = [x for b in ld for x in b]
    # sequences touching tokens 65,536 .. 131,071 of shard 1: (131072 - 65536) / 512 + 1
    lost = len(ref) - len(got)
    assert lost == 129 and ld.stats()["corrupt_skipped"] == lost
    assert set(got) <= {sample_id(s) for s in ref}


def test_token_index_edit_is_refused(tmp_path):
    root = build_token_dataset(str(tmp_path / "t"), 2, 3000, seq_len=64)
    m = DatasetManifest.load(root)
    idx = os.path.join(root, m.shards[0].index)
    _flip(idx, os.path.getsize(idx) - 20)  # inside the offsets table
    with pytest.raises(ShardError, match=m.shards[0].index):
        _all(StreamingDataset(root, seed=0))
    with pytest.raises(ShardError, match="checksum"):
        TokenShard(os.path.join(root, m.shards[0].name))


def test_state_beyond_a_shrunk_dataset_names_the_change_or_restarts(stream_data, tmp_path):
    """Issue 12 item 12: the fingerprint check comes before the range check."""
    src = stream_data("tar_b")
    root = _copy(src, str(tmp_path / "ds"))
    ld = StatefulLoader(StreamingDataset(root, seed=0), batch_size=4, collate_fn=ids_collate)
    it = iter(ld)
    for _ in range(14):  # 56 of 61 samples consumed
        next(it)
    state = ld.state_dict()
    assert state["samples_consumed"] == 56
    shutil.rmtree(root)
    build_tar_dataset(root, 30, prefix="b")  # the dataset shrank below the saved position
    ds2 = StreamingDataset(root, seed=0)
    with pytest.raises(ValueError, match="the dataset changed since the checkpoint") as ei:
        StatefulLoader(ds2, batch_size=4).load_state_dict(state)
    assert "outside" not in str(ei.value)
    ld2 = StatefulLoader(
        ds2, batch_size=4, collate_fn=ids_collate, on_dataset_change="restart_epoch"
    )
    ld2.load_state_dict(state)
    assert (ld2.epoch, ld2.samples_consumed) == (0, 0)
    assert len([x for b in ld2 for x in b]) == 32  # 30 samples, the last batch padded


def test_rerunning_pack_upgrades_an_index_without_checksums(tmp_path):
    """An output of an older unbroken (format-1 indexes, recorded in its resume state) is
    rewritten by a re-run, not kept: kept, its samples would stay unverified."""
    from datakit import build_tar_dataset as build

    root = build(str(tmp_path / "ds"), 20)
    state_path = os.path.join(root, ".unbroken-pack.json")
    st = json.load(open(state_path))
    name = sorted(st["shards"])[0]
    raw = _downgrade_tar_index(os.path.join(root, name + ".idx"))
    st["shards"][name]["info"]["index_checksum"] = checksum_bytes(raw)
    st["shards"][name]["info"]["index_bytes"] = len(raw)
    with open(state_path, "w") as f:
        json.dump(st, f)
    build(root, 20)  # the same input again
    assert open(os.path.join(root, name + ".idx"), "rb").read(8) == b"UBIDX\x02\x00\x00"


# 5: the shard's first read goes through the index's views (up to 8 samples of a shard of 120:
# reader._PLAN_AFTER), later ones through its row table;
# 120: one read through the row table
@pytest.mark.parametrize("group", [5, 120])
def test_damage_found_in_small_and_large_groups_of_one_shard(tmp_path, group):
    root = build_tar_dataset(str(tmp_path / "ds"), 120, shard_size=1 << 20)  # one shard
    tar, key, off = _member(root, 0, 77, "bin")
    _flip(tar, off + 100)
    ds = StreamingDataset(root, shuffle=False, on_corrupt="skip")
    got = [s for a in range(0, 120, group) for s in ds.read(0, np.arange(a, min(a + group, 120)))]
    assert [s["__key__"] for s in got] == [f"s{i:05d}" for i in range(120) if i != 77]
    assert ds.corrupt_skipped == 1
    with pytest.raises(CorruptSampleError, match=f"'{key}' member 'bin'"):
        StreamingDataset(root, shuffle=False).read(0, np.arange(120)[77 - group // 2 :][:group])


@pytest.mark.parametrize("layout", ["one", "three", "mixed"])
@pytest.mark.parametrize("group", [3, 40])
def test_damage_named_in_every_sample_layout(tmp_path, layout, group):
    """The read loops per layout (one member, three members, a different set per sample),
    each for a shard's first small read and for its row table: the damaged member is named,
    skipped and counted; every other sample arrives exactly."""
    from unbroken.data.prepare.pack import pack

    rng = np.random.default_rng(5)
    want = []
    for i in range(40):
        s: dict[str, object] = {"__key__": f"k{i:03d}", "bin": rng.bytes(200 + i)}
        if layout == "three" or (layout == "mixed" and i % 2):
            s["json"] = b'{"i": %d}' % i
            s["seg.png"] = rng.bytes(30)
        want.append(s)
    root = str(tmp_path / layout)
    pack(
        iter(want),
        root,
        shard_size=1 << 20,
        workers=1,
        fsync=False,
        progress=False,
        allow_partial=layout == "mixed",
    )
    member = "bin" if layout == "one" else "seg.png"
    victim = 21  # odd: it has seg.png in the mixed layout
    tar, key, off = _member(root, 0, victim, member)
    _flip(tar, off + 3)
    ds = StreamingDataset(root, shuffle=False, on_corrupt="skip")
    got = [s for a in range(0, 40, group) for s in ds.read(0, np.arange(a, min(a + group, 40)))]
    assert got == [s for i, s in enumerate(want) if i != victim]
    assert ds.corrupt_skipped == 1
    with pytest.raises(CorruptSampleError, match=f"'{key}' member '{member}'"):
        StreamingDataset(root, shuffle=False).read(0, np.arange(victim - 1, 40)[:group])


# --- issue 20: dataset.json is the one root ----------------------------------------------------


def _v1_fingerprint(d: dict) -> str:
    """The fingerprint an unbroken before issue 20 wrote (dataset.json version 1): over kind,
    seq_len and each shard's name, sample count and checksum only."""
    import xxhash

    h = xxhash.xxh3_128()
    h.update(f"unbroken-dataset/1/{d['kind']}/{d.get('seq_len')}\n".encode())
    for s in d["shards"]:
        h.update(f"{s['name']}\t{s['samples']}\t{s['checksum']}\n".encode())
    return h.hexdigest()


def test_new_content_under_the_old_tar_checksum_is_another_dataset(stream_data, tmp_path):
    """Issue 20 item 9: rebuild one shard's idx over new tar content but stating the old tar
    checksum, and update only that index's checksum in dataset.json. The fingerprint covers
    every shard's and index's checksum, so the edited dataset.json no longer matches its own
    fingerprint; re-fingerprinted, it is another dataset and a resume onto it is refused."""
    import dataclasses

    from unbroken.data.manifest import ManifestError, ShardInfo
    from unbroken.data.tar.reader import index_tar

    root = _copy(stream_data("tar"), str(tmp_path / "ds"))
    m = DatasetManifest.load(root)
    ld = StatefulLoader(StreamingDataset(root, seed=0), batch_size=4, collate_fn=ids_collate)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    del it
    tar, key, off = _member(root, 2, 0, "bin")
    _flip(tar, off + 5)  # new content, same size
    forged = dataclasses.replace(index_tar(tar), tar_checksum=m.shards[2].checksum)
    raw = forged.to_bytes()
    with open(os.path.join(root, m.shards[2].index), "wb") as f:
        f.write(raw)
    d = json.load(open(os.path.join(root, "dataset.json")))
    assert d["shards"][2]["index_bytes"] == len(raw)
    d["shards"][2]["index_checksum"] = checksum_bytes(raw)
    with open(os.path.join(root, "dataset.json"), "w") as f:
        json.dump(d, f)
    with pytest.raises(ManifestError, match="fingerprint .* does not match"):
        DatasetManifest.load(root)
    edited = DatasetManifest.create("tar", [ShardInfo.from_json(s) for s in d["shards"]])
    assert edited.fingerprint != m.fingerprint
    edited.save(root)
    ds = StreamingDataset(root, seed=0)
    with pytest.raises(ValueError, match="the dataset changed since the checkpoint"):
        StatefulLoader(ds, batch_size=4).load_state_dict(state)


def test_a_dataset_json_of_the_previous_version_reads_with_the_full_fingerprint(
    stream_data, tmp_path
):
    """Issue 20 item 9: a version-1 dataset.json (written before the fingerprint covered the
    indexes) is read as it is: its stored fingerprint must still match the old formula (an
    edit is refused as before), and its fingerprint is recomputed over every field, equal to
    what this version writes for the same files. A resume state saved on the old fingerprint
    is refused by name, with the fix."""
    from unbroken.data.manifest import ManifestError

    src = stream_data("tar")
    root = _copy(src, str(tmp_path / "ds"))
    path = os.path.join(root, "dataset.json")
    d = json.load(open(path))
    d["version"], d["fingerprint"] = 1, _v1_fingerprint(d)
    with open(path, "w") as f:
        json.dump(d, f)
    m = DatasetManifest.load(root)
    assert m.fingerprint == DatasetManifest.load(src).fingerprint != d["fingerprint"]
    ds = StreamingDataset(root, seed=0)
    assert [sample_id(s) for s in _all(ds)] == [
        sample_id(s) for s in _all(StreamingDataset(src, seed=0))
    ]
    old = {
        "version": 1,
        "fingerprint": d["fingerprint"],
        "seed": 0,
        "epoch": 0,
        "samples_consumed": 8,
        "shuffle_window": list(ds.shuffle_window),
    }
    with pytest.raises(ValueError, match="version 1.*restart_epoch") as ei:
        StatefulLoader(ds, batch_size=4).load_state_dict(old)
    assert "the dataset changed since the checkpoint" in str(ei.value)
    d["shards"][0]["samples"] += 1
    d["num_samples"] += 1
    with open(path, "w") as f:
        json.dump(d, f)
    with pytest.raises(ManifestError, match="fingerprint .* does not match"):
        DatasetManifest.load(root)


def test_terminal_escapes_from_dataset_files_are_refused_or_shown_escaped(
    stream_data, tmp_path, capsys
):
    """Issue 20 item 11 (data): strings a dataset.json carries into messages (shard and index
    names, checksums) are refused when they hold control characters (the refusal shows them
    escaped), and what `data report` prints from a data_bench.json is escaped."""
    from unbroken.cli import main
    from unbroken.data.diagnose.bottleneck import BottleneckReport, StageResult
    from unbroken.data.manifest import ManifestError

    esc = "\x1b[2J\x1b[32mVERIFIED OK\u202e"
    root = _copy(stream_data("tar_b"), str(tmp_path / "ds"))
    path = os.path.join(root, "dataset.json")
    good = json.load(open(path))
    for field in ("name", "index", "checksum", "index_checksum"):
        d = json.loads(json.dumps(good))
        d["shards"][0][field] = esc + d["shards"][0][field]
        d["version"], d["fingerprint"] = 1, _v1_fingerprint(d)  # consistent, as written before
        with open(path, "w") as f:
            json.dump(d, f)
        with pytest.raises(ManifestError) as ei:
            DatasetManifest.load(root)
        assert "\x1b" not in str(ei.value) and "\u202e" not in str(ei.value), field
        assert main(["data", "inspect", root, "--epochs", "1"]) == 2
        err = capsys.readouterr().err
        assert "\x1b" not in err and "\u202e" not in err, (field, err)

    run = tmp_path / "run"
    run.mkdir()
    stage = StageResult("shard read" + esc, "worker" + esc, 100.0, 1.0, "note" + esc)
    report = BottleneckReport(
        stages=(stage,),
        batch_size=8,
        num_workers=1,
        cpu_count=2,
        consume_rate=None,
        worker_rate=100.0,
        pipeline_rate=100.0,
        limiting="shard read" + esc,
        bottleneck="shard read" + esc,
        suggested_workers=1,
        suggested_prefetch_factor=2,
        advice=("advice" + esc,),
    )
    (run / "data_bench.json").write_text(json.dumps(report.to_json()))
    assert main(["data", "report", str(run), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "VERIFIED OK" in out and "\x1b" not in out and "\u202e" not in out
