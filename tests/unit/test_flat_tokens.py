"""Flat token files (nanoGPT's train.bin + meta.pkl) as a first-class source: issue 21 item 2.

Indexed in place (no copy), read as the exact-resume epoch stream and as random windows
(nanoGPT's get_batch, resumable), verified against the index like a token shard, turned into
token shards by ``unbroken data tokenize --from-bin``, batches as contiguous ``(x, y)``; the
vocabulary read from meta.pkl without running code from it.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import pytest
import torch

from unbroken.cli import main as cli_main
from unbroken.data import StatefulLoader, StreamingDataset
from unbroken.data.tar.reader import CorruptSampleError
from unbroken.data.tokens.flat import flat_manifest, index_flat, read_vocab_size

T = 20_000  # tokens; token i is i % 65536, so a window names its own start


def _flat(tmp_path, n: int = T, vocab: int = 65_536) -> str:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (np.arange(n) % vocab).astype(np.uint16).tofile(d / "train.bin")
    with open(d / "meta.pkl", "wb") as f:  # as nanoGPT's shakespeare_char/prepare.py writes it
        pickle.dump({"vocab_size": vocab, "itos": {0: "a"}, "stoi": {"a": 0}}, f)
    return str(d / "train.bin")


def _rows(batch) -> np.ndarray:
    return np.asarray(batch)


def test_flat_file_is_indexed_in_place_and_read_as_the_epoch_stream(tmp_path) -> None:
    """issue 21 item 2: index_flat writes .idx + .dataset.json beside train.bin and copies
    nothing; StreamingDataset(train.bin) reads windows of seq_len + 1 through np.memmap of the
    file itself, every window once per epoch, sharded across ranks like token shards."""
    path = _flat(tmp_path)
    before = os.stat(path)
    m = index_flat(path, meta=os.path.join(os.path.dirname(path), "meta.pkl"))
    assert m.vocab_size == 65_536 and m.dtype == "uint16" and m.shards[0].tokens == T
    assert sorted(os.listdir(os.path.dirname(path))) == [
        "meta.pkl",
        "train.bin",
        "train.bin.dataset.json",
        "train.bin.idx",
    ]
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    L = 16
    seen = []
    for rank in range(2):
        ds = StreamingDataset(path, seq_len=L, shuffle=False, rank=rank, world_size=2)
        reader = ds._readers[0]
        assert reader._shard(0).tokens.filename == os.path.abspath(path)  # mapped, not copied
        for b in StatefulLoader(ds, batch_size=4, last_batch="drop"):
            for row in _rows(b):
                assert row.tolist() == list(range(row[0], row[0] + L + 1))
                assert row[0] % L == 0
                seen.append(int(row[0]))
    n = (T - 1) // L
    assert sorted(seen) == [i * L for i in range(n // 8 * 8)]  # 2 ranks x 4: whole steps


def test_index_flat_is_idempotent_and_notices_a_changed_file(tmp_path) -> None:
    """issue 21 item 2: a second call (every rank may call it) reads nothing when the file is
    unchanged; a rewritten file is indexed again, and the fingerprint follows it."""
    path = _flat(tmp_path)
    m1 = index_flat(path, vocab_size=65_536)
    idx = path + ".idx"
    t_idx = os.stat(idx).st_mtime_ns
    assert index_flat(path, vocab_size=65_536) == m1 and os.stat(idx).st_mtime_ns == t_idx
    (np.arange(T) % 50).astype(np.uint16).tofile(path)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    m2 = index_flat(path, vocab_size=65_536)
    assert m2.fingerprint != m1.fingerprint


def test_flat_file_without_its_index_names_the_command(tmp_path) -> None:
    """issue 21 item 2: the error says how to index it."""
    path = _flat(tmp_path)
    with pytest.raises(FileNotFoundError, match="unbroken data index .*train.bin --meta"):
        StreamingDataset(path, seq_len=8)


def test_flat_file_damage_is_detected_like_a_shard(tmp_path) -> None:
    """issue 21 item 2: a bit flipped in train.bin after indexing is a CorruptSampleError
    naming the file and block; a truncated one is refused when opened."""
    path = _flat(tmp_path)
    index_flat(path, vocab_size=65_536)
    with open(path, "r+b") as f:
        f.seek(3 * 2)
        b = f.read(1)
        f.seek(3 * 2)
        f.write(bytes([b[0] ^ 0x10]))
    ds = StreamingDataset(path, seq_len=8, shuffle=False)
    with pytest.raises(CorruptSampleError, match="train.bin"):
        next(iter(StatefulLoader(ds, batch_size=2)))
    with open(path, "r+b") as f:
        f.truncate(T * 2 - 2)
    with pytest.raises(Exception, match="truncated"):
        next(iter(StatefulLoader(StreamingDataset(path, seq_len=8), batch_size=2)))


def test_ids_outside_the_vocabulary_and_odd_sizes_are_refused(tmp_path) -> None:
    """issue 21 item 2: a wrong vocabulary or dtype is caught at indexing, naming the token."""
    path = _flat(tmp_path)
    with pytest.raises(ValueError, match="token 100 is id 100, outside a vocabulary of 100"):
        index_flat(path, vocab_size=100)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        index_flat(path, vocab_size=65_536)


def test_meta_pkl_is_read_without_running_code(tmp_path) -> None:
    """issue 21 item 2, T-NO-CODE: meta.pkl is untrusted. A real nanoGPT meta.pkl gives its
    vocab_size; one whose unpickling would call os.system is refused and runs nothing; so are
    a non-dict, a missing vocab_size and an oversized file."""
    good = tmp_path / "meta.pkl"
    chars = sorted(set("hello world"))
    with open(good, "wb") as f:
        pickle.dump(
            {
                "vocab_size": len(chars),
                "itos": dict(enumerate(chars)),
                "stoi": {c: i for i, c in enumerate(chars)},
            },
            f,
        )
    assert read_vocab_size(str(good)) == len(chars)

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "evil.pkl"
    bad.write_bytes(pickle.dumps({"vocab_size": 65, "x": Evil()}))
    with pytest.raises(ValueError, match=r"refused as a meta.pkl .*(posix|os)\.system"):
        read_vocab_size(str(bad))
    assert not marker.exists()
    (tmp_path / "list.pkl").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ValueError, match="no positive integer 'vocab_size'"):
        read_vocab_size(str(tmp_path / "list.pkl"))
    (tmp_path / "neg.pkl").write_bytes(pickle.dumps({"vocab_size": -3}))
    with pytest.raises(ValueError, match="no positive integer"):
        read_vocab_size(str(tmp_path / "neg.pkl"))
    big = tmp_path / "big.pkl"
    with open(big, "wb") as f:
        f.truncate((64 << 20) + 1)
    with pytest.raises(ValueError, match="larger than"):
        read_vocab_size(str(big))


def _random_batches(path: str, n: int, **kw) -> list[np.ndarray]:
    ds = StreamingDataset(path, seq_len=32, windows="random", seed=7, **kw)
    it = StatefulLoader(ds, batch_size=4).forever()
    return [np.asarray(next(it)) for _ in range(n)]


def test_random_windows_are_nanogpt_windows_drawn_from_the_position(tmp_path) -> None:
    """issue 21 item 2: windows='random' starts each sample at a uniform token offset in
    [0, T - seq_len) (nanoGPT's torch.randint(len(data) - block_size)), not at multiples of
    seq_len; the draws are the same for any num_workers, differ by seed, and cover the file."""
    path = _flat(tmp_path)
    index_flat(path, vocab_size=65_536)
    got = _random_batches(path, 50)
    starts = np.concatenate([b[:, 0] for b in got]).astype(np.int64)
    for b in got:
        for row in b:
            assert row.tolist() == list(range(row[0], row[0] + 33))
    assert starts.min() >= 0 and starts.max() < T - 32
    assert (starts % 32 != 0).mean() > 0.9  # not the fixed grid
    assert starts.max() - starts.min() > T // 2
    ds = StreamingDataset(path, seq_len=32, windows="random", seed=7)
    workers = StatefulLoader(ds, batch_size=4, num_workers=2).forever()
    for b in got:
        assert np.array_equal(np.asarray(next(workers)), b)
    other = _random_batches(path, 3, **{"shuffle": True})
    assert all(
        np.array_equal(a, b) for a, b in zip(other, got[:3], strict=True)
    )  # shuffle: no effect
    ds9 = StreamingDataset(path, seq_len=32, windows="random", seed=9)
    assert not np.array_equal(np.asarray(next(iter(StatefulLoader(ds9, batch_size=4)))), got[0])


def test_random_windows_resume_exactly_and_across_epochs(tmp_path) -> None:
    """issue 21 item 2: the RNG stream of the random windows is the loader's position, so a
    state saved after k batches resumes the very next draws - also past an epoch end, and on
    another world size (the union of the ranks' windows is the uninterrupted sequence)."""
    path = _flat(tmp_path, n=2_000)  # 62 windows of 32 per epoch: epochs end often
    index_flat(path, vocab_size=65_536)
    ds = StreamingDataset(path, seq_len=32, windows="random", seed=3)
    full = StatefulLoader(ds, batch_size=4)
    it = full.forever()
    ref = [np.asarray(next(it)) for _ in range(40)]  # > 2 epochs (15 batches + a pad each)
    for k in (0, 5, 15, 16, 23):
        first = StatefulLoader(
            StreamingDataset(path, seq_len=32, windows="random", seed=3), batch_size=4
        )
        it1 = first.forever()
        for _ in range(k):
            next(it1)
        sd = first.state_dict()
        assert sd["windows"] == "random"
        again = StatefulLoader(
            StreamingDataset(path, seq_len=32, windows="random", seed=3), batch_size=4
        )
        again.load_state_dict(sd)
        it2 = again.forever()
        for j in range(k, 40):
            assert np.array_equal(np.asarray(next(it2)), ref[j]), (k, j)
    # two ranks of batch 2 see, step by step, the windows of one rank of batch 4
    halves = []
    for r in range(2):
        d = StreamingDataset(path, seq_len=32, windows="random", seed=3, rank=r, world_size=2)
        i2 = StatefulLoader(d, batch_size=2).forever()
        halves.append([np.asarray(next(i2)) for _ in range(10)])
    for j in range(10):
        both = sorted(map(tuple, np.concatenate([halves[0][j], halves[1][j]]).tolist()))
        assert both == sorted(map(tuple, ref[j].tolist()))
    fixed = StatefulLoader(StreamingDataset(path, seq_len=32, seed=3), batch_size=4)
    with pytest.raises(ValueError, match="windows='random'"):
        fixed.load_state_dict(sd)


def test_xy_batches_are_contiguous_inputs_and_targets(tmp_path) -> None:
    """issue 21 item 2: LoaderConfig.xy gives (x, y) of shape (B, seq_len), contiguous (made in
    the worker), y the targets of x - what nanoGPT's get_batch returns; with and without
    workers, with ids."""
    path = _flat(tmp_path)
    index_flat(path, vocab_size=65_536)
    kws: tuple[dict[str, Any], ...] = (
        {},
        {"num_workers": 2},
        {"num_workers": 2, "shm_transport": False},
    )
    for kw in kws:
        ds = StreamingDataset(path, seq_len=16, windows="random", seed=1)
        rows = next(iter(StatefulLoader(ds, batch_size=3, **kw)))
        x, y = next(iter(StatefulLoader(ds, batch_size=3, xy=True, **kw)))
        assert isinstance(x, torch.Tensor) and x.dtype == torch.int64
        assert x.shape == y.shape == (3, 16) and x.is_contiguous() and y.is_contiguous()
        assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:])
        assert y.view(-1).numel() == 48
    ds = StreamingDataset(path, seq_len=16, seed=1, with_ids=True)
    x, y, ids = next(iter(StatefulLoader(ds, batch_size=3, xy=True)))
    assert ids.shape == (3,) and torch.equal(x[:, 0], ids * 16)
    # random windows: a sample's id is its window's token offset (what the drill compares)
    ds = StreamingDataset(path, seq_len=16, seed=1, with_ids=True, windows="random")
    x, y, ids = next(iter(StatefulLoader(ds, batch_size=3, xy=True)))
    assert torch.equal(x[:, 0], ids) and bool((ids % 16 != 0).any())


def test_tokenize_from_bin_makes_shards_with_the_same_stream(tmp_path) -> None:
    """issue 21 item 2: `unbroken data tokenize --from-bin train.bin OUT --seq-len L` writes
    token shards whose epoch stream is the flat file's, window for window."""
    path = _flat(tmp_path)
    index_flat(path, vocab_size=65_536)
    out = str(tmp_path / "shards")
    rc = cli_main(
        ["data", "tokenize", path, out, "--from-bin", "--seq-len", "16", "--shard-size", "4096"]
    )
    assert rc == 0
    m = flat_manifest(path)
    assert len(os.listdir(out)) > 6 and m.vocab_size == 65_536
    a = StreamingDataset(path, seq_len=16, shuffle=False)
    b = StreamingDataset(out, shuffle=False)
    ra = [np.asarray(x) for x in StatefulLoader(a, batch_size=8)]
    rb = [np.asarray(x) for x in StatefulLoader(b, batch_size=8)]
    assert len(ra) == len(rb) and all(np.array_equal(p, q) for p, q in zip(ra, rb, strict=True))


def test_data_index_command_indexes_a_flat_file(tmp_path, capsys) -> None:
    """issue 21 item 2: `unbroken data index train.bin --meta meta.pkl`."""
    path = _flat(tmp_path)
    meta = os.path.join(os.path.dirname(path), "meta.pkl")
    assert cli_main(["data", "index", path, "--meta", meta]) == 0
    assert "65536" in capsys.readouterr().out
    assert flat_manifest(path).vocab_size == 65_536


def test_random_slots_are_uniform_and_keyed() -> None:
    """issue 21 item 2: the window starts are uniform over [0, room) (chi-square over 20 bins
    of 200k draws), differ by seed, epoch and fingerprint, and are a pure function."""
    from unbroken.data.stream.order import random_slots

    pos = np.arange(200_000)
    s = random_slots("fp", 0, 0, pos, 1_000_003)
    assert s.min() >= 0 and s.max() < 1_000_003
    counts = np.bincount(s * 20 // 1_000_003, minlength=20)
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert chi2 < 60, chi2  # 19 degrees of freedom: p < 1e-5 above ~50
    assert np.array_equal(s, random_slots("fp", 0, 0, pos, 1_000_003))
    for other in (("fp", 1, 0), ("fp", 0, 1), ("fq", 0, 0)):
        assert (random_slots(*other, pos[:100], 1_000_003) != s[:100]).mean() > 0.95
    assert np.array_equal(random_slots("fp", 0, 0, pos[5:9], 1_000_003), s[5:9])
