"""A vocabulary size from ``meta.pkl`` or ``--vocab-size`` that no token file can hold (token
ids are at most uint32): refused where it enters, naming the file or the option, instead
of being written into a ``dataset.json`` that its own reader then refuses."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from unbroken.data.manifest import DatasetManifest
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.tokens.flat import flat_manifest, index_flat, read_vocab_size
from unbroken.data.tokens.shard import dtype_for_vocab


@pytest.mark.parametrize("vocab", [(1 << 32) + 1, 1 << 40, 10**30])
def test_a_meta_pkl_vocab_beyond_uint32_is_refused_naming_the_file(tmp_path, vocab):
    meta = tmp_path / "meta.pkl"
    meta.write_bytes(pickle.dumps({"vocab_size": vocab, "itos": {0: "a"}}))
    with pytest.raises(ValueError, match="vocab_size") as ei:
        read_vocab_size(str(meta))
    assert str(meta) in str(ei.value)
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match=str(meta)):
        index_flat(str(path), meta=str(meta), fsync=False)
    assert not (tmp_path / "train.bin.dataset.json").exists()


@pytest.mark.parametrize("vocab", [(1 << 32) + 1, 1 << 40])
def test_a_vocab_size_beyond_uint32_is_refused_naming_the_option(tmp_path, vocab):
    with pytest.raises(ValueError, match="uint32"):
        dtype_for_vocab(vocab)
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="vocab"):
        index_flat(str(path), vocab_size=vocab, fsync=False)


def test_the_largest_uint32_vocabulary_still_indexes_and_reads(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint32).tofile(path)
    m = index_flat(str(path), vocab_size=1 << 32, fsync=False)
    assert m.dtype == "uint32" and flat_manifest(str(path)) == m
    assert DatasetManifest.parse(m.dumps().encode(), source="x").vocab_size == 1 << 32
    ds = StreamingDataset(str(path), seq_len=9, seed=0)
    assert len(ds.read(0, np.arange(ds.epoch_length))) == ds.epoch_length > 0
