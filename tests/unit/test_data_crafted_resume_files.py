"""A damaged resume file of ``pack`` / ``tokenize`` (``.unbroken-pack.json``,
``.unbroken-tokenize.json`` in the output directory): the file only says which committed
shards may be kept, and every kept shard is verified anyway, so damage there means "write
those shards again" - never a traceback from inside (AttributeError, RecursionError,
ManifestError out of a record), and the output is byte for byte the output of a clean run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from unbroken.data.prepare.pack import pack
from unbroken.data.tokens.tokenizer import tokenize


def _files(root: str) -> dict[str, bytes]:
    return {
        n: open(os.path.join(root, n), "rb").read()
        for n in sorted(os.listdir(root))
        if not n.startswith(".unbroken-")
    }


def _samples(n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(3)
    return [
        {"__key__": f"k{i:04d}", "bin": rng.bytes(int(rng.integers(100, 900)))} for i in range(n)
    ]


def _first_record(st: dict[str, Any]) -> dict[str, Any]:
    shards = st["shards"]
    return shards[sorted(shards)[0]] if isinstance(shards, dict) else shards[0]


EDITS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "a-list": lambda st: [],
    "deep": lambda st: "DEEP",
    "record-not-an-object": lambda st: _set_first(st, []),
    "bad-checksum": lambda st: _set_info(st, "checksum", "zz"),
    "count-infinite": lambda st: _set_info(st, "samples", float("inf")),
    "name-with-slash": lambda st: _set_info(st, "name", "../escape.tar"),
}


def _set_first(st: dict[str, Any], value: Any) -> dict[str, Any]:
    shards = st["shards"]
    if isinstance(shards, dict):
        shards[sorted(shards)[0]] = value
    else:
        shards[0] = value
    return st


def _set_info(st: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    rec = _first_record(st)
    rec.get("info", rec)[key] = value  # pack: {"plan", "info"}; tokenize: the record
    return st


def _damage(path: str, edit: str) -> None:
    with open(path) as f:
        st = json.load(f)
    new = EDITS[edit](st)
    text = "[" * 100_000 + "]" * 100_000 if new == "DEEP" else json.dumps(new)
    with open(path, "w") as f:
        f.write(text)


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_pack_rewrites_what_a_damaged_resume_file_describes(tmp_path, edit):
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    pack(iter(_samples(40)), ref, shard_size=12_000, workers=1, fsync=False, progress=False)
    pack(iter(_samples(40)), out, shard_size=12_000, workers=1, fsync=False, progress=False)
    _damage(os.path.join(out, ".unbroken-pack.json"), edit)
    pack(iter(_samples(40)), out, shard_size=12_000, workers=1, fsync=False, progress=False)
    assert _files(out) == _files(ref)
    assert not os.path.exists(str(tmp_path / "escape.tar"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(5)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    path = str(tmp_path_factory.mktemp("corpus") / "c.jsonl")
    with open(path, "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(1, 40))))}))
            f.write("\n")
    return path


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_tokenize_rewrites_what_a_damaged_resume_file_describes(tmp_path, corpus, edit):
    out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    kw: dict[str, Any] = {"seq_len": 16, "shard_size": 2000, "workers": 1, "progress": False}
    tokenize(corpus, str(tmp_path / "bpe"), train_bpe_vocab=300, **kw)
    tok = str(tmp_path / "bpe" / "tokenizer.json")
    tokenize(corpus, ref, tokenizer=tok, **kw)
    tokenize(corpus, out, tokenizer=tok, **kw)
    _damage(os.path.join(out, ".unbroken-tokenize.json"), edit)
    tokenize(corpus, out, tokenizer=tok, **kw)
    assert _files(out) == _files(ref)
