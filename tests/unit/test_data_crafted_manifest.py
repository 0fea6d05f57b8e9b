"""Crafted ``dataset.json`` files (T-NO-WRONG-BYTE, T-BOUNDED): values an edit, a foreign tool
or a hostile copy can hold *with a fingerprint that matches* (the fingerprint is a checksum,
anyone can recompute it), so only the manifest's own checks stand between them and a reader.

Every case must end in a ``ValueError`` (``ManifestError`` / ``ShardError``) that names the
file and the offending value, or in the exact samples: never an ``OverflowError``,
``RecursionError``, ``IndexError`` from deep inside, nor memory in proportion to a lied-about
size.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from datakit import build_tar_dataset, build_token_dataset
from unbroken.data.manifest import DatasetManifest, ManifestError, ShardInfo, fingerprint
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.tar.reader import ShardError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def tar_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tar_dataset(str(tmp_path_factory.mktemp("tar") / "ds"), 24, shard_size=12_000)


@pytest.fixture(scope="module")
def tok_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("tok") / "ds")
    return build_token_dataset(out, 3, 2000, seq_len=8, block_tokens=256)


def _refingerprint(d: dict[str, Any]) -> None:
    """Make the stored fingerprint and sample total match the edited fields, as a hostile
    editor would; left alone when the edited fields do not parse at all."""
    try:
        shards = [ShardInfo.from_json(s) for s in d["shards"]]
        d["fingerprint"] = fingerprint(
            d["kind"],
            shards,
            seq_len=d.get("seq_len"),
            dtype=d.get("dtype"),
            eos_id=d.get("eos_id"),
            vocab_size=d.get("vocab_size"),
        )
        d["num_samples"] = sum(s.samples for s in shards)
    except Exception:  # noqa: BLE001 - a value the reader must refuse on its own
        pass


def _craft(src: str, dst: str, edit: Callable[[dict[str, Any]], None]) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "dataset.json")
    with open(path) as f:
        d = json.load(f)
    edit(d)
    _refingerprint(d)
    with open(path, "w") as f:
        f.write(json.dumps(d))
    return dst


def _raw(src: str, dst: str, text: Callable[[str], str]) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "dataset.json")
    with open(path) as f:
        old = f.read()
    with open(path, "w") as f:
        f.write(text(old))
    return dst


def _read_all(root: str, **kw: Any) -> list[Any]:
    """The epoch's samples (its first 10,000 positions, for a count that lies)."""
    ds = StreamingDataset(root, seed=0, **kw)
    return ds.read(0, np.arange(min(ds.epoch_length, 10_000)))


def _refused(root: str, *names: str, exc: type[Exception] = ValueError, **kw: Any) -> str:
    """The dataset is refused with ``exc`` whose message names one of ``names``."""
    with pytest.raises(exc) as ei:
        _read_all(root, **kw)
    msg = str(ei.value)
    assert any(n in msg for n in names), f"{type(ei.value).__name__}: {msg}"
    return msg


# --- the JSON itself ------------------------------------------------------------------------


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deeply_nested_json_is_a_manifest_error_not_a_recursion_error(tar_root, tmp_path, opener):
    closer = "]" if opener == "[" else "}"
    root = _raw(tar_root, str(tmp_path / "d"), lambda _: opener * 100_000 + "1" + closer * 100_000)
    with pytest.raises(ManifestError, match=r"dataset\.json.*nest"):
        DatasetManifest.load(root)
    _refused(root, "dataset.json")


@pytest.mark.parametrize(
    "field,value",
    [
        ("samples", "Infinity"),
        ("samples", "-Infinity"),
        ("bytes", "Infinity"),
        ("index_bytes", "NaN"),
        ("num_samples", "Infinity"),
    ],
)
def test_non_finite_numbers_are_refused_by_name(tar_root, tmp_path, field, value):
    # Python's json reads the JavaScript literals Infinity/NaN; int() of them overflows.
    pat = re.compile(rf'"{field}": -?\d+')
    root = _raw(tar_root, str(tmp_path / "d"), lambda t: pat.sub(f'"{field}": {value}', t, 1))
    with pytest.raises(ManifestError) as ei:
        DatasetManifest.load(root)
    assert "dataset.json" in str(ei.value) and field in str(ei.value), ei.value


@pytest.mark.parametrize("field", ["eos_id", "seq_len", "vocab_size"])
def test_non_finite_token_fields_are_refused_by_name(tok_root, tmp_path, field):
    def edit(t: str) -> str:
        d = json.loads(t)
        d[field] = 0  # a placeholder the text edit below turns into Infinity
        return json.dumps(d).replace(f'"{field}": 0', f'"{field}": Infinity')

    root = _raw(tok_root, str(tmp_path / "d"), edit)
    with pytest.raises(ManifestError) as ei:
        DatasetManifest.load(root)
    assert "dataset.json" in str(ei.value) and field in str(ei.value), ei.value


@pytest.mark.parametrize(
    "value",
    [3.7, True, "7", 2**63, 2**64 + 3, 10**40, -1],
    ids=["float", "bool", "string", "2**63", "2**64+3", "10**40", "negative"],
)
def test_a_sample_count_of_the_wrong_type_or_range_is_refused(tar_root, tmp_path, value):
    """A count is a JSON integer in [0, 2**63): a float, bool or string is not silently
    truncated or converted, and a count no int64 holds never reaches numpy."""
    root = _craft(
        tar_root, str(tmp_path / "d"), lambda d: d["shards"][1].__setitem__("samples", value)
    )
    with pytest.raises(ManifestError) as ei:
        DatasetManifest.load(root)
    msg = str(ei.value)
    assert "dataset.json" in msg and "samples" in msg, msg


@pytest.mark.parametrize("field", ["documents", "tokens"])
def test_negative_token_counts_are_refused(tok_root, tmp_path, field):
    root = _craft(tok_root, str(tmp_path / "d"), lambda d: d["shards"][0].__setitem__(field, -3))
    with pytest.raises(ManifestError, match=rf"dataset\.json.*{field}"):
        DatasetManifest.load(root)


def test_a_shard_name_longer_than_a_file_name_can_be_is_refused_unprinted(tar_root, tmp_path):
    """A 100 kB name is no file name (NAME_MAX is 255 bytes); the error does not echo it."""
    root = _craft(
        tar_root, str(tmp_path / "d"), lambda d: d["shards"][0].__setitem__("name", "a" * 100_000)
    )
    with pytest.raises(ManifestError) as ei:
        DatasetManifest.load(root)
    assert "dataset.json" in str(ei.value) and len(str(ei.value)) < 2_000, str(ei.value)[:300]


# --- counts that lie about the shards (fingerprint recomputed) --------------------------------


@pytest.mark.parametrize("extra", [1, 5, 2**40])
@pytest.mark.parametrize("verify", [True, False])
def test_more_tar_samples_than_the_index_holds_is_refused_at_open(
    tar_root, tmp_path, extra, verify
):
    """dataset.json's sample count of a shard must be its index's: a larger one reached
    ``rows.take`` as an IndexError (or asked numpy for terabytes)."""
    root = _craft(
        tar_root,
        str(tmp_path / "d"),
        lambda d: d["shards"][0].__setitem__("samples", d["shards"][0]["samples"] + extra),
    )
    name = DatasetManifest.load(root).shards[0].name
    msg = _refused(root, name, exc=ShardError, verify=verify)
    assert "samples" in msg and "dataset.json" in msg, msg


def test_fewer_tar_samples_than_the_index_holds_is_refused_too(tar_root, tmp_path):
    root = _craft(
        tar_root,
        str(tmp_path / "d"),
        lambda d: d["shards"][0].__setitem__("samples", d["shards"][0]["samples"] - 1),
    )
    _refused(root, DatasetManifest.load(root).shards[0].name)


@pytest.mark.parametrize("verify", [True, False])
def test_more_token_sequences_than_the_shard_holds_is_refused_at_open(tok_root, tmp_path, verify):
    root = _craft(
        tok_root,
        str(tmp_path / "d"),
        lambda d: d["shards"][1].__setitem__("samples", d["shards"][1]["samples"] + 3),
    )
    name = DatasetManifest.load(root).shards[1].name
    msg = _refused(root, name, exc=ShardError, verify=verify)
    assert "sequences" in msg and "dataset.json" in msg, msg


@pytest.mark.parametrize("kw", [{"seq_len": 4}, {"windows": "random"}], ids=["seq_len", "random"])
def test_a_token_count_that_lies_is_refused_at_open(tok_root, tmp_path, kw):
    """With another seq_len, or random windows, the counts come from dataset.json's per-shard
    ``tokens``: a larger one read past the end of the map (IndexError)."""
    root = _craft(
        tok_root,
        str(tmp_path / "d"),
        lambda d: d["shards"][0].__setitem__("tokens", d["shards"][0]["tokens"] + 500),
    )
    _refused(root, DatasetManifest.load(root).shards[0].name, **kw)


def test_a_huge_seq_len_costs_no_memory_before_the_shards_refuse_it(tok_root, tmp_path):
    """seq_len = 2**40 in dataset.json (fingerprint recomputed): no window of that length
    exists in any shard, so the recorded sample counts are refused at open - before any
    array of seq_len + 1 entries is allocated (that was an 8 TiB MemoryError)."""
    root = _craft(tok_root, str(tmp_path / "d"), lambda d: d.__setitem__("seq_len", 2**40))
    _refused(root, "tokens-000000.bin")


def test_a_consistent_crafted_manifest_still_reads_exactly(tar_root, tmp_path):
    """The checks refuse lies only: extra provenance and the fingerprint recomputed over the
    same values change nothing that is read."""
    want = _read_all(tar_root)
    root = _craft(tar_root, str(tmp_path / "d"), lambda d: d.__setitem__("extra", {"x": [1]}))
    got = _read_all(root)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in want]
    assert all(bytes(a["bin"]) == bytes(b["bin"]) for a, b in zip(got, want, strict=True))


# --- file names that collide --------------------------------------------------------------


def _name(i: int, field: str, to: str) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        d["shards"][i][field] = to

    return edit


@pytest.mark.parametrize(
    "edit,bad",
    [
        (lambda d: _name(1, "index", d["shards"][0]["index"])(d), "shard-000000.tar.idx"),
        (lambda d: _name(0, "index", d["shards"][0]["name"])(d), "shard-000000.tar"),
        (lambda d: _name(1, "name", d["shards"][0]["index"])(d), "shard-000000.tar.idx"),
        (_name(0, "index", "dataset.json"), "dataset.json"),
        (_name(2, "name", "dataset.json"), "dataset.json"),
        (_name(1, "name", ".tmp-shard-000001.tar.1234abcd"), ".tmp-"),
        (_name(1, "index", ".tmp-x"), ".tmp-"),
    ],
    ids=[
        "index-twice",
        "index-is-its-shard",
        "shard-is-an-index",
        "index-is-manifest",
        "shard-is-manifest",
        "shard-is-a-temporary",
        "index-is-a-temporary",
    ],
)
def test_every_file_name_is_distinct_and_no_manifest_or_temporary(tar_root, tmp_path, edit, bad):
    """Each name dataset.json lists is one file of its own: two records naming the same file
    (staging and the node cache then write it twice, evict it under the other), a record
    naming dataset.json itself (overwritten by the staged manifest), or a temporary's name
    (removed as a dead download's by the next stage or cache opening) are refused."""
    root = _craft(tar_root, str(tmp_path / "d"), edit)
    with pytest.raises(ManifestError) as ei:
        DatasetManifest.load(root)
    msg = str(ei.value)
    assert "dataset.json" in msg and bad in msg, msg


# --- seeded: many field edits at once, fingerprint recomputed ----------------------------------

_VALUES: list[Any] = [None, "", "x", -1, 0, 1, 2, 7, 8, 9, 2**31, 2**32, 2**32 + 1, 2**62]
_VALUES += [2**63 - 1, 2**63, 1.5, True, [], {}, "uint16", "uint32", "tar", "tokens", "a" * 300]


def _stream_holds(streams: list[np.ndarray], row: np.ndarray) -> bool:
    """Whether ``row`` is a contiguous run of one shard's tokens (ids count up: unique)."""
    for s in streams:
        for h in np.flatnonzero(s == row[0]).tolist():
            if h + len(row) <= len(s) and np.array_equal(s[h : h + len(row)], row):
                return True
    return False


def test_seeded_field_edits_with_a_matching_fingerprint_read_true_bytes_or_fail_by_name(
    tar_root, tok_root, tmp_path
):
    """800 seeded manifests, each with 1-3 fields of dataset.json or its shard records set to
    an edge value (wrong type, off by one, 2**63, ...) and the fingerprint recomputed, read
    through StreamingDataset (verify on / off, skip, another seq_len, random windows): a
    ValueError (ManifestError, ShardError, ...) or samples made only of the packed bytes.
    Before the fixes above this met IndexError, OverflowError and MemoryError."""
    from unbroken.data.tokens.shard import TokenShard

    roots = {k: shutil.copytree(r, str(tmp_path / k)) for k, r in (("tar", tar_root), ("tok", tok_root))}  # fmt: skip
    pristine = {k: open(os.path.join(r, "dataset.json")).read() for k, r in roots.items()}
    packed = {(s["__key__"], bytes(s["bin"])) for s in _read_all(roots["tar"])}
    m = DatasetManifest.load(roots["tok"])
    streams = [np.asarray(TokenShard(m.shard_path(roots["tok"], i)).tokens) for i in range(3)]
    rng = random.Random(5)
    tally = {"refused": 0, "read": 0}
    for case in range(800):
        kind = rng.choice(sorted(roots))
        d = json.loads(pristine[kind])
        what = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.6:
                i = rng.randrange(len(d["shards"]))
                s = d["shards"][i]
                key = rng.choice([*sorted(s), "documents", "tokens"])
                v = rng.choice([*_VALUES, *(x.get(key) for x in d["shards"])])
                if type(s.get(key)) is int and rng.random() < 0.5:
                    v = s[key] + rng.choice([-1, 1, 100])
                s[key] = v
                what.append(f"shards[{i}].{key}={v!r}"[:60])
            else:
                key = rng.choice(["kind", "seq_len", "dtype", "eos_id", "vocab_size", "version"])
                d[key] = rng.choice(_VALUES)
                what.append(f"{key}={d[key]!r}"[:60])
        _refingerprint(d)
        with open(os.path.join(roots[kind], "dataset.json"), "w") as f:
            f.write(json.dumps(d))
        options: list[dict[str, Any]] = [{}, {"verify": False}, {"on_corrupt": "skip"}]
        if kind == "tok":
            options += [{"seq_len": 5}, {"windows": "random"}]
        kw = rng.choice(options)
        label = f"case {case}: {kind} {kw} {', '.join(what)}"
        try:
            got = _read_all(roots[kind], **kw)
        except ValueError:
            tally["refused"] += 1
            continue
        except Exception as e:
            raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
        for smp in got:
            if kind == "tar":
                ok = smp is None or (smp["__key__"], bytes(smp["bin"])) in packed
            else:
                ok = smp is None or _stream_holds(streams, np.asarray(smp))
            assert ok, f"{label}: WRONG SAMPLE"
        tally["read"] += 1
    for k, r in roots.items():
        with open(os.path.join(r, "dataset.json"), "w") as f:
            f.write(pristine[k])
    assert tally["refused"] > 500 and tally["read"] > 50, tally
