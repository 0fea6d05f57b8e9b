"""Multi-process data preparation: byte-identical output for 1, 2 and 4 workers, resume after
a real SIGKILL of pack / tokenize (process group included), and the CLI commands."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from unbroken.cli import main as cli_main
from unbroken.data.manifest import DatasetManifest
from unbroken.data.prepare.pack import pack
from unbroken.data.tar.reader import ShardReader
from unbroken.data.tokens.shard import TokenShard
from unbroken.data.tokens.tokenizer import tokenize

_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()


def _tree(root: str, n: int) -> None:
    rng = np.random.default_rng(n)
    for i in range(n):
        d = os.path.join(root, f"g{i % 4}")
        os.makedirs(d, exist_ok=True)
        open(os.path.join(d, f"{i:05d}.bin"), "wb").write(rng.bytes(int(rng.integers(1, 3000))))
        open(os.path.join(d, f"{i:05d}.cls"), "w").write(str(i % 10))


def _corpus(path: str, n: int) -> str:
    rng = np.random.default_rng(n)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(
                json.dumps({"text": " ".join(rng.choice(_WORDS, int(rng.integers(1, 80))))}) + "\n"
            )
    return path


def _files(root: str) -> dict[str, bytes]:
    """Every published file (hidden resume state excluded)."""
    return {
        n: open(os.path.join(root, n), "rb").read()
        for n in sorted(os.listdir(root))
        if not n.startswith(".")
    }


def test_pack_output_identical_for_1_2_4_workers(tmp_path: str) -> None:
    src = os.path.join(tmp_path, "src")
    _tree(src, 200)
    outs = {}
    for w in (1, 2, 4):
        out = os.path.join(tmp_path, f"o{w}")
        pack(src, out, shard_size=40_000, workers=w, progress=False)
        outs[w] = _files(out)
    assert len(outs[1]) > 20 and outs[1] == outs[2] == outs[4]


def test_pack_in_memory_output_identical_for_1_2_4_workers(tmp_path: str) -> None:
    """Column batches travel to worker processes and come out as the same bytes."""
    rng = np.random.default_rng(7)
    samples = [
        {"__key__": f"{i:05d}", "bin": rng.bytes(int(rng.integers(0, 3000))), "cls": i % 10}
        for i in range(600)
    ]
    outs = {}
    for w in (1, 2, 4):
        out = os.path.join(tmp_path, f"m{w}")
        pack(samples, out, shard_size=60_000, workers=w, progress=False, fsync=False)
        outs[w] = _files(out)
    assert len(outs[1]) > 20 and outs[1] == outs[2] == outs[4]


def test_tokenize_output_identical_for_1_2_4_workers(tmp_path: str) -> None:
    src = _corpus(os.path.join(tmp_path, "c.jsonl"), 3000)
    tok = os.path.join(tmp_path, "tok.json")
    outs = {}
    for w in (1, 2, 4):
        out = os.path.join(tmp_path, f"t{w}")
        tokenize(
            src,
            out,
            tokenizer=tok,
            train_bpe_vocab=400,
            seq_len=32,
            shard_size=20_000,
            workers=w,
            progress=False,
        )
        outs[w] = _files(out)
    assert len(outs[1]) > 10 and outs[1] == outs[2] == outs[4]


_SLOW_CHILD = r"""
import time
import unbroken.data.prepare.pack, unbroken.data.tar.writer, unbroken.data.tokens.shard, unbroken.data.tokens.tokenizer
cls = unbroken.data.{writer}
orig = cls.commit
def slow(self, *a, **k):
    r = orig(self, *a, **k)
    time.sleep(0.25)  # widen the window so the parent can kill mid-run
    return r
cls.commit = slow
unbroken.data.{call}
"""


def _recorded(out: str, state: str) -> int:
    """How many finished shards the run's state file in ``out`` records (what a resume
    reuses; a shard's files can exist before the parent records it)."""
    try:
        with open(os.path.join(out, state), "rb") as f:
            return len(json.load(f)["shards"])
    except FileNotFoundError:
        return 0


def _kill_when(cmd: str, out: str, state: str, count: int, timeout: float = 60) -> None:
    """Run ``cmd`` in its own process group; SIGKILL the group once its state file in
    ``out`` records ``count`` finished shards. (Counting committed ``.idx`` files instead
    killed a loaded run whose parent had recorded only one of four: nothing to reuse.)"""
    p = subprocess.Popen(
        [sys.executable, "-c", cmd],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    t0 = time.monotonic()
    try:
        while True:
            if _recorded(out, state) >= count:
                break
            if p.poll() is not None:
                raise AssertionError(f"child ended before the kill: {p.stderr.read().decode()}")  # type: ignore[union-attr]
            if time.monotonic() - t0 > timeout:
                raise AssertionError("child made no progress")
            time.sleep(0.01)
    finally:
        # a child that already ended (and was reaped by poll) has no group left to kill;
        # its own error, raised above, is the one to show
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL


def test_pack_resumes_after_sigkill(tmp_path: str) -> None:
    src, out, ref = (os.path.join(tmp_path, n) for n in ("src", "out", "ref"))
    _tree(src, 240)
    call = f"prepare.pack.pack({src!r}, {out!r}, shard_size=30_000, workers=2, progress=False)"
    _kill_when(
        _SLOW_CHILD.format(writer="tar.writer.TarShardWriter", call=call),
        out,
        ".unbroken-pack.json",
        3,
    )
    assert not os.path.exists(os.path.join(out, "dataset.json"))  # never looks complete
    res = pack(src, out, shard_size=30_000, workers=2, progress=False)
    assert res.shards_reused >= 2 and res.shards_written >= 1  # resumed, not restarted
    pack(src, ref, shard_size=30_000, workers=1, progress=False)
    assert _files(out) == _files(ref)
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]


def test_tokenize_resumes_after_sigkill(tmp_path: str) -> None:
    src = _corpus(os.path.join(tmp_path, "c.jsonl"), 3000)
    out, ref = os.path.join(tmp_path, "out"), os.path.join(tmp_path, "ref")
    tok = os.path.join(tmp_path, "tok.json")
    kw: dict[str, Any] = dict(tokenizer=tok, seq_len=32, shard_size=12_000, progress=False)
    tokenize(src, ref, train_bpe_vocab=400, workers=1, **kw)  # also trains tok.json
    call = f"tokens.tokenizer.tokenize({src!r}, {out!r}, workers=2, **{kw!r})"
    _kill_when(
        _SLOW_CHILD.format(writer="tokens.shard.TokenShardWriter", call=call),
        out,
        ".unbroken-tokenize.json",
        3,
    )
    assert not os.path.exists(os.path.join(out, "dataset.json"))
    res = tokenize(src, out, workers=2, **kw)
    assert res.shards_reused >= 2 and res.shards_written >= 1
    assert _files(out) == _files(ref)


def test_cli_pack_index_tokenize_stage(tmp_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    src = os.path.join(tmp_path, "src")
    _tree(src, 30)
    out = os.path.join(tmp_path, "packed")
    assert (
        cli_main(
            ["data", "pack", src, out, "--shard-size", "20KB", "--workers", "2", "--no-progress"]
        )
        == 0
    )
    assert "30 samples in" in capsys.readouterr().out
    m = DatasetManifest.load(out)
    os.unlink(os.path.join(out, "dataset.json"))
    for s in m.shards:
        os.unlink(os.path.join(out, s.index))
    assert cli_main(["data", "index", out, "--workers", "1"]) == 0
    assert DatasetManifest.load(out).fingerprint == m.fingerprint  # same shards, same identity
    staged = os.path.join(tmp_path, "staged")
    assert cli_main(["data", "stage", out, staged, "--no-progress"]) == 0
    assert f"{2 * len(m.shards)} files copied" in capsys.readouterr().out
    assert ShardReader(m.shard_path(staged, 0))[0]["__key__"] == "g0/00000"
    corpus = _corpus(os.path.join(tmp_path, "c.jsonl"), 50)
    toks = os.path.join(tmp_path, "toks")
    assert (
        cli_main(
            [
                "tokenize",
                corpus,
                toks,
                "--train-bpe",
                "300",
                "--seq-len",
                "8",
                "--no-progress",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert "50 documents" in capsys.readouterr().out
    assert TokenShard(os.path.join(toks, "tokens-000000.bin")).num_documents == 50
    assert (
        cli_main(
            ["data", "tokenize", corpus, toks, "--tokenizer", os.path.join(tmp_path, "no.json")]
        )
        == 2
    )
    assert "no.json: tokenizer file not found" in capsys.readouterr().err
    assert cli_main(["data", "pack", src, out, "--shard-size", "1KB", "--no-progress"]) == 2
    assert "shard_size=1000 is below the minimum" in capsys.readouterr().err
