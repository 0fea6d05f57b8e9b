"""Token shards (format, document and sequence slicing) and `tokenize` end to end."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from unbroken.data.manifest import DatasetManifest
from unbroken.data.prepare.pack import pack
from unbroken.data.tar.reader import ShardError
from unbroken.data.tokens.shard import TokenShard, TokenShardWriter, dtype_for_vocab, num_sequences
from unbroken.data.tokens.tokenizer import load_tokenizer, tokenize

_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards box nightly".split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, int(rng.integers(1, 60)))) for _ in range(n)]


def _jsonl(path: str, docs: list[str]) -> str:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    return path


def test_token_shard_documents_and_sequences(tmp_path: str) -> None:
    p = os.path.join(tmp_path, "t.bin")
    w = TokenShardWriter(p, "uint16", eos_id=0, fsync=False)
    docs = [np.arange(1, 6), np.arange(10, 13), np.array([], dtype=np.int64), np.arange(20, 24)]
    w.add(docs[0])
    w.add_many(np.concatenate(docs[1:]), np.array([len(d) for d in docs[1:]]))
    w.commit()
    ts = TokenShard(p)
    flat = [1, 2, 3, 4, 5, 0, 10, 11, 12, 0, 0, 20, 21, 22, 23, 0]
    assert ts.tokens.tolist() == flat and ts.dtype == np.uint16 and ts.eos_id == 0
    assert np.memmap(p, dtype=np.uint16).tolist() == flat  # plain nanoGPT-style .bin
    assert ts.num_documents == 4
    for i, d in enumerate(docs):
        assert ts.document(i).tolist() == d.tolist()
    assert ts.document(-1).tolist() == [20, 21, 22, 23]
    # 16 tokens, seq_len 4: windows start at 0, 4, 8; the one at 12 lacks its 5th token.
    assert ts.num_sequences(4) == 3 == num_sequences(16, 4)
    assert ts.sequence(2, 4).tolist() == flat[8:13]
    assert ts.num_sequences(5) == 3 and ts.sequence(2, 5).tolist() == flat[10:16]
    with pytest.raises(IndexError, match="sequence 3 out of range"):
        ts.sequence(3, 4)
    ts.verify()


def test_token_shard_damage_is_detected(tmp_path: str) -> None:
    p = os.path.join(tmp_path, "t.bin")
    w = TokenShardWriter(p, "uint32", eos_id=7, fsync=False)
    w.add(np.arange(100))
    w.commit()
    with open(p, "r+b") as f:
        f.seek(8)
        f.write(b"\xff")
    with pytest.raises(ShardError, match=r"t\.bin: checksum .* damaged"):
        TokenShard(p).verify()
    with open(p, "r+b") as f:
        f.truncate(40)
    with pytest.raises(ShardError, match=r"t\.bin: 40 bytes but its index describes 101 tokens"):
        TokenShard(p)
    os.unlink(p + ".idx")
    with pytest.raises(FileNotFoundError, match=r"t\.bin\.idx: token index missing"):
        TokenShard(p)


def test_dtype_choice_and_vocab_too_large_for_uint16() -> None:
    assert dtype_for_vocab(65_536) == "uint16"
    assert dtype_for_vocab(65_537) == "uint32"
    with pytest.raises(ValueError, match="vocabulary of 70000 tokens is too large for uint16"):
        dtype_for_vocab(70_000, "uint16")


def test_tokenize_jsonl_with_trained_bpe_round_trips(tmp_path: str) -> None:
    docs = _docs(300)
    src = _jsonl(os.path.join(tmp_path, "c.jsonl"), docs)
    out = os.path.join(tmp_path, "out")
    res = tokenize(
        src, out, train_bpe_vocab=300, seq_len=16, shard_size=4000, workers=1, progress=False
    )
    m = DatasetManifest.load(out)
    assert m.kind == "tokens" and m.dtype == "uint16" and m.seq_len == 16 and len(m.shards) > 3
    tok = load_tokenizer(os.path.join(out, "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == m.eos_id
    got: list[str] = []
    for i, s in enumerate(m.shards):
        ts = TokenShard(m.shard_path(out, i))
        assert s.samples == ts.num_sequences(16) and s.documents == ts.num_documents
        assert ts.num_tokens * 2 <= 4000
        ends = ts.offsets[1:] - 1
        assert (ts.tokens[ends] == m.eos_id).all()  # EOS after every document
        got += [tok.decode(ts.document(d).tolist()) for d in range(ts.num_documents)]
    assert got == docs
    assert res.documents == 300 and res.tokens == sum(s.tokens or 0 for s in m.shards)
    assert m.num_samples == sum(s.samples for s in m.shards)


def test_tokenize_text_files_and_tar_shards(tmp_path: str) -> None:
    docs = _docs(40, seed=1)
    txt = os.path.join(tmp_path, "txt")
    os.makedirs(txt)
    for i, d in enumerate(docs):
        open(os.path.join(txt, f"{i:03d}.txt"), "w").write(d)
    tok = os.path.join(tmp_path, "tok.json")
    a = tokenize(
        txt,
        os.path.join(tmp_path, "a"),
        train_bpe_vocab=280,
        tokenizer=tok,
        workers=1,
        progress=False,
    )
    tars = os.path.join(tmp_path, "tars")
    pack([{"txt": d} for d in docs], tars, shard_size=20_000, progress=False)
    b = tokenize(tars, os.path.join(tmp_path, "b"), tokenizer=tok, workers=1, progress=False)
    ta = TokenShard(os.path.join(tmp_path, "a", "tokens-000000.bin"))
    tb = TokenShard(os.path.join(tmp_path, "b", "tokens-000000.bin"))
    assert ta.tokens.tolist() == tb.tokens.tolist() and a.documents == b.documents == 40
    assert b.manifest.seq_len is None and b.manifest.num_samples == 40  # a sample = a document


def test_tokenize_errors_name_file_and_fix(tmp_path: str) -> None:
    src = _jsonl(os.path.join(tmp_path, "c.jsonl"), _docs(20))
    out = os.path.join(tmp_path, "out")
    with pytest.raises(
        FileNotFoundError, match=r"nope\.json: tokenizer file not found.*--train-bpe"
    ):
        tokenize(src, out, tokenizer=os.path.join(tmp_path, "nope.json"), progress=False)
    tok = os.path.join(tmp_path, "tok.json")
    tokenize(src, out, train_bpe_vocab=300, tokenizer=tok, workers=1, progress=False)
    with open(src, "a") as f:
        f.write(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:21: no JSON string field 'text'.*--field"):
        tokenize(src, out, tokenizer=tok, workers=1, progress=False)
    big = _jsonl(os.path.join(tmp_path, "big.jsonl"), ["fox " * 3000])
    with pytest.raises(ValueError, match=r"big\.jsonl:1: document of \d+ tokens exceeds"):
        tokenize(big, out, tokenizer=tok, shard_size=1000, workers=1, progress=False)
    with pytest.raises(ValueError, match="no end-of-text token.*--eos-token"):
        tokenize(src, out, tokenizer=tok, eos_token="<nope>", workers=1, progress=False)


def test_vocabulary_too_large_for_uint16_in_tokenize(tmp_path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    vocab["[UNK]"] = 70_001
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    path = os.path.join(tmp_path, "big.json")
    t.save(path)
    src = _jsonl(os.path.join(tmp_path, "c.jsonl"), ["w1 w69999 w5", "w2"])
    with pytest.raises(ValueError, match="too large for uint16"):
        tokenize(src, os.path.join(tmp_path, "o"), tokenizer=path, dtype="uint16", progress=False)
    res = tokenize(src, os.path.join(tmp_path, "o"), tokenizer=path, workers=1, progress=False)
    ts = TokenShard(res.manifest.shard_path(os.path.join(tmp_path, "o"), 0))
    assert res.manifest.dtype == "uint32" and ts.document(0).tolist() == [1, 69_999, 5]


def test_rerun_with_other_seq_len_reuses_shards_and_recounts(tmp_path: str) -> None:
    src = _jsonl(os.path.join(tmp_path, "c.jsonl"), _docs(200))
    tok = os.path.join(tmp_path, "tok.json")
    a, b = os.path.join(tmp_path, "a"), os.path.join(tmp_path, "b")
    kw = dict(tokenizer=tok, shard_size=3000, workers=1, progress=False)
    tokenize(src, a, train_bpe_vocab=300, seq_len=16, **kw)  # type: ignore[arg-type]
    again = tokenize(src, a, seq_len=32, **kw)  # type: ignore[arg-type]
    fresh = tokenize(src, b, seq_len=32, **kw)  # type: ignore[arg-type]
    assert again.shards_written == 0 and again.shards_reused == len(fresh.manifest.shards)
    assert again.manifest == fresh.manifest
    assert again.manifest.fingerprint == fresh.manifest.fingerprint


@pytest.mark.timeout(120)
def test_tokenize_with_workers_ends_in_a_process_that_handles_sigterm(tmp_path: str) -> None:
    """A training process (the Checkpointer's preemption flag) hands its SIGTERM handler to
    tokenize's forked workers; the pool's terminate() then stopped nothing and tokenize hung in
    the join, on success and on a bad line alike."""
    import signal

    small = _jsonl(os.path.join(tmp_path, "small.jsonl"), _docs(200))
    tokenize(small, os.path.join(tmp_path, "bpe"), train_bpe_vocab=300, workers=1, progress=False)
    good = _jsonl(os.path.join(tmp_path, "good.jsonl"), _docs(12_000))  # six chunks in flight
    bad = os.path.join(tmp_path, "bad.jsonl")
    with open(good) as f, open(bad, "w") as g:
        g.write(f.read() + "not json\n")
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # noted, not obeyed
    try:
        kw: dict = dict(tokenizer=os.path.join(tmp_path, "bpe", "tokenizer.json"), workers=2)
        res = tokenize(good, os.path.join(tmp_path, "out"), progress=False, **kw)
        assert res.documents == 12_000
        with pytest.raises(ValueError, match=r"bad\.jsonl:12001"):
            tokenize(bad, os.path.join(tmp_path, "out2"), progress=False, **kw)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_tokenize_in_one_process_leaves_the_callers_sigterm_handler(tmp_path: str) -> None:
    """With ``workers=1`` the workers' initializer ran in the caller's own process and set
    SIGTERM back to the default there: a training process lost its preemption handler."""
    import signal

    src = _jsonl(os.path.join(tmp_path, "c.jsonl"), _docs(200))

    def mine(*_: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        tokenize(src, os.path.join(tmp_path, "out"), train_bpe_vocab=300, workers=1, progress=False)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_train_bpe_of_another_size_trains_again_and_never_overwrites_a_given_tokenizer(
    tmp_path: str,
) -> None:
    """A rerun with ``--train-bpe`` of another size silently reused the tokenizer trained by
    the first run: the dataset came out with the old vocabulary. It now trains again (the
    shards follow the new tokenizer); a tokenizer the user named is never overwritten."""
    src = _jsonl(os.path.join(tmp_path, "c.jsonl"), _docs(300))
    out = os.path.join(tmp_path, "out")
    tokenize(src, out, train_bpe_vocab=300, seq_len=16, workers=1, progress=False)
    tok_path = os.path.join(out, "tokenizer.json")
    assert load_tokenizer(tok_path).get_vocab_size() == 300
    tokenize(src, out, train_bpe_vocab=280, seq_len=16, workers=1, progress=False)
    assert load_tokenizer(tok_path).get_vocab_size() == 280
    m = DatasetManifest.load(out)
    assert (
        max(int(TokenShard(m.shard_path(out, i)).tokens.max()) for i in range(len(m.shards))) < 280
    )

    mine = os.path.join(tmp_path, "mine.json")
    with open(tok_path, "rb") as f, open(mine, "wb") as g:
        g.write(f.read())
    with pytest.raises(ValueError, match=r"mine\.json.*280.*260"):
        tokenize(src, out, tokenizer=mine, train_bpe_vocab=260, workers=1, progress=False)
    assert load_tokenizer(mine).get_vocab_size() == 280


@pytest.mark.parametrize("size", [1, 3])
def test_a_shard_size_that_holds_no_document_is_refused_by_its_option_before_training(
    tmp_path, size: int
) -> None:
    """A --shard-size too small for two tokens is named as the option the user typed, with
    the smallest value that works, before a tokenizer is trained (which can take minutes)."""
    src = tmp_path / "c.txt"
    src.write_text("hello world\n" * 50)
    out = tmp_path / "out"
    with pytest.raises(
        ValueError, match=rf"shard_size={size} bytes \(--shard-size\).*--shard-size 4 or more"
    ):
        tokenize(str(src), str(out), train_bpe_vocab=300, shard_size=size, progress=False)
    assert not out.exists() or not any(out.iterdir())
