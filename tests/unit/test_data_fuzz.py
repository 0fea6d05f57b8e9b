"""Fuzzing every file a reader opens (T-NO-WRONG-BYTE, issue 12): seeded mutations of the tar
shards, their ``.idx``, ``dataset.json``, token ``.bin`` files and token indexes - bit flips,
byte overwrites, truncations, appended bytes, deletions and field edits of the manifest.

After each mutation every sample is read through ``StreamingDataset`` (raise and skip modes)
and through ``ShardReader`` / ``TokenShard`` directly. The only allowed outcomes:

* the exact original samples (the mutation hit bytes no sample is made of), or
* a ShardError / ManifestError / FileNotFoundError whose message names the damaged file
  (for a manifest field edit: dataset.json or the file the field describes);
* in skip mode: a subset of the exact originals, the missing ones counted.

A wrong sample, any other exception type, or an error that does not name the file fails the
test, with the seed and the mutation in the message so it replays.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from datakit import build_tar_dataset, build_token_dataset
from unbroken.data.manifest import ManifestError
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.tar.reader import ShardError, ShardReader
from unbroken.data.tokens.shard import TokenShard

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NAMED = (ShardError, ManifestError, FileNotFoundError)


def _epoch(root: str, **kw: Any) -> tuple[list[Any], StreamingDataset]:
    ds = StreamingDataset(root, seed=0, **kw)
    return ds.read(0, np.arange(ds.epoch_length)), ds


def _as_key(s: Any) -> Any:
    return s["__key__"] if isinstance(s, dict) else s.tobytes()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)


def _direct(root: str, kind: str, names: list[str]) -> list[Any]:
    """Every sample through ShardReader / TokenShard (no manifest), shard by shard."""
    out: list[Any] = []
    for n in names:
        p = os.path.join(root, n)
        if kind == "tar":
            with ShardReader(p) as r:
                out += list(r)
                out += [r[i] for i in range(len(r) - 1, -1, -3)]
        else:
            ts = TokenShard(p)
            out += [ts.document(i).copy() for i in range(ts.num_documents)]
            out += [ts.sequence(i, 8).copy() for i in range(ts.num_sequences(8))]
    return out


class _Mutation:
    """One seeded change of one file; :meth:`undo` puts the pristine bytes back."""

    def __init__(self, root: str, rng: random.Random, pristine: dict[str, bytes]) -> None:
        self.root = root
        self.name = rng.choice(sorted(pristine))
        self.path = os.path.join(root, self.name)
        self.old = pristine[self.name]
        data = bytearray(self.old)
        kinds = ["flip", "flip", "flip", "overwrite", "truncate", "append", "delete"]
        if self.name == "dataset.json":
            kinds += ["field"] * 6
        self.kind = rng.choice(kinds)
        self.field: tuple[str, ...] = ()
        if self.kind == "flip" and data:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
            self.what = f"bit flip at byte {i}"
        elif self.kind == "overwrite" and data:
            i = rng.randrange(len(data))
            n = rng.randint(1, 64)
            data[i : i + n] = bytes(rng.getrandbits(8) for _ in range(len(data[i : i + n])))
            self.what = f"{n} random bytes at {i}"
        elif self.kind == "truncate":
            n = rng.randrange(len(data)) if data else 0
            del data[n:]
            self.what = f"truncated to {n} bytes"
        elif self.kind == "append":
            data += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 600)))
            self.what = "bytes appended"
        elif self.kind == "field":
            data = bytearray(self._edit_field(rng).encode())
        else:
            self.kind = "delete"
            self.what = "deleted"
        self.data = None if self.kind == "delete" else bytes(data)

    def _edit_field(self, rng: random.Random) -> str:
        d = json.loads(self.old)
        if rng.random() < 0.7:
            i = rng.randrange(len(d["shards"]))
            s = d["shards"][i]
            key = rng.choice(sorted(s))
            other = d["shards"][(i + 1) % len(d["shards"])]
            holder, where = s, f"shards[{i}].{key}"
            # the files this field describes: an error may name them instead of dataset.json
            self.field = (s["name"], s["index"])
        else:
            key = rng.choice(sorted(d))
            other, holder, where = {}, d, key
        v = holder[key]
        choices: list[Any] = [None, "", "x", -1, 0, 2**64, [], {}, "../../etc/passwd"]
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            pass
        elif isinstance(v, int):
            choices += [v + 1, v - 1, v * 2]
        else:
            choices += [v[:-1] + ("0" if v[-1:] != "0" else "1"), v.upper(), v + "x"]
        if key in other:
            choices.append(other[key])
        holder[key] = rng.choice(choices)
        if rng.random() < 0.1:
            del holder[key]
            self.what = f"field {where} removed"
        else:
            self.what = f"field {where} = {holder[key]!r}"
        return json.dumps(d)

    def apply(self) -> None:
        if self.data is None:
            os.unlink(self.path)
        else:
            with open(self.path, "wb") as f:
                f.write(self.data)

    def undo(self) -> None:
        with open(self.path, "wb") as f:
            f.write(self.old)

    def names_the_file(self, msg: str) -> bool:
        if self.name in msg:
            return True
        if self.name == "dataset.json":
            return any(f in msg for f in self.field)
        # a shard and its index are one pair: a size or checksum mismatch between them may be
        # reported on either (e.g. a truncated tar no longer matches its index)
        partner = self.name[: -len(".idx")] if self.name.endswith(".idx") else self.name + ".idx"
        return partner in msg

    def __str__(self) -> str:
        return f"{self.name}: {self.what}"


def _fuzz(root: str, kind: str, cases: int, seed: int) -> dict[str, int]:
    pristine = {n: open(os.path.join(root, n), "rb").read() for n in sorted(os.listdir(root))}
    want, _ = _epoch(root)
    shards = [n for n in sorted(pristine) if n.endswith((".tar", ".bin"))]
    want_direct = _direct(root, kind, shards)
    by_key = {_as_key(s): s for s in want}
    rng = random.Random(seed)
    tally = {"exact": 0, "named error": 0, "skipped some": 0}

    def check(m: _Mutation, label: str, fn: Callable[[], list[Any]], ref: list[Any]) -> str:
        try:
            got = fn()
        except NAMED as e:
            assert m.names_the_file(str(e)), (
                f"seed {seed}, {m}, {label}: error does not name the file: {e}"
            )
            return "named error"
        except Exception as e:
            raise AssertionError(f"seed {seed}, {m}, {label}: {type(e).__name__}: {e}") from e
        assert len(got) == len(ref) and all(map(_same, ref, got)), (
            f"seed {seed}, {m}, {label}: WRONG SAMPLES DELIVERED"
        )
        return "exact"

    for _ in range(cases):
        m = _Mutation(root, rng, pristine)
        m.apply()
        try:
            outcome = check(m, "StreamingDataset", lambda: _epoch(root)[0], want)
            tally[outcome] += 1
            if m.name != "dataset.json":
                check(m, "direct", lambda: _direct(root, kind, shards), want_direct)
            try:
                got, ds = _epoch(root, on_corrupt="skip")
            except NAMED as e:
                assert m.names_the_file(str(e)), f"seed {seed}, {m}, skip: {e}"
            else:
                for s in got:
                    ref = by_key.get(_as_key(s))
                    assert ref is not None and _same(ref, s), (
                        f"seed {seed}, {m}: wrong sample (skip)"
                    )
                assert ds.corrupt_skipped == len(want) - len(got), f"seed {seed}, {m}: count"
                if len(got) < len(want):
                    tally["skipped some"] += 1
        finally:
            m.undo()
    return tally


def test_fuzz_tar_dataset(tmp_path):
    root = build_tar_dataset(str(tmp_path / "tar"), 24, shard_size=12_000)
    assert len([n for n in os.listdir(root) if n.endswith(".tar")]) >= 4
    tally = _fuzz(root, "tar", cases=700, seed=1)
    print(tally)
    # the mutations reach both outcomes: payload damage and manifest/index damage
    assert tally["named error"] > 200 and tally["exact"] > 20 and tally["skipped some"] > 10


def test_fuzz_token_dataset(tmp_path):
    root = build_token_dataset(str(tmp_path / "tok"), 3, 2000, seq_len=8, block_tokens=256)
    tally = _fuzz(root, "tokens", cases=500, seed=2)
    print(tally)
    assert tally["named error"] > 150 and tally["skipped some"] > 10


def test_fuzz_replays_from_its_seed(tmp_path):
    """The same seed gives the same mutations (a failure message replays)."""
    root = build_tar_dataset(str(tmp_path / "tar"), 6, shard_size=12_000)
    pristine = {n: open(os.path.join(root, n), "rb").read() for n in sorted(os.listdir(root))}
    a = [str(_Mutation(root, r, pristine)) for r in [random.Random(5)] for _ in range(30)]
    b = [str(_Mutation(root, r, pristine)) for r in [random.Random(5)] for _ in range(30)]
    assert a == b and len(set(a)) > 20
    shutil.rmtree(root)
