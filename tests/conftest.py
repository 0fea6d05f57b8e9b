"""Shared fixtures. Data builders for the streaming-dataset tests (tar via the real packer,
token shards via the real TokenShardWriter) - small, deterministic, identity-carrying."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest


def build_tar_dataset(out: str, n: int, *, prefix: str = "s", shard_size: int = 12_000) -> str:
    """``n`` samples keyed ``<prefix><i:05d>`` with a 300-700 byte payload, 2-4 per shard."""
    from unbroken.data.pack import pack  # lazily: this conftest serves every test

    rng = np.random.default_rng(n)
    samples = (
        {
            "__key__": f"{prefix}{i:05d}",
            "bin": rng.bytes(int(rng.integers(300, 700))),
            "cls": str(i).encode(),
        }
        for i in range(n)
    )
    pack(samples, out, shard_size=shard_size, workers=1, fsync=False, progress=False)
    return out


def build_token_dataset(
    out: str, shards: int, tokens_per_shard: int, *, seq_len: int, doc_len: int = 37
) -> str:
    """Token ids count up from 1 across the dataset (EOS = 0 between documents), so the
    largest id of a sequence identifies it uniquely."""
    from unbroken._fs import checksum_bytes
    from unbroken.data.manifest import DatasetManifest, ShardInfo
    from unbroken.data.tokens import TokenShardWriter, num_sequences

    os.makedirs(out, exist_ok=True)
    infos = []
    nxt = 1
    for s in range(shards):
        name = f"tokens-{s:06d}.bin"
        w = TokenShardWriter(os.path.join(out, name), "uint32", 0, fsync=False)
        left = tokens_per_shard
        while left > 0:
            k = min(doc_len, left)
            w.add(np.arange(nxt, nxt + k))
            nxt += k
            left -= k + 1
        nbytes, digest, raw = w.commit()
        infos.append(
            ShardInfo(
                name=name,
                samples=num_sequences(w.num_tokens, seq_len),
                bytes=nbytes,
                checksum=digest,
                index=name + ".idx",
                index_bytes=len(raw),
                index_checksum=checksum_bytes(raw),
                documents=w.num_documents,
                tokens=w.num_tokens,
            )
        )
    DatasetManifest.create("tokens", infos, dtype="uint32", eos_id=0, seq_len=seq_len).save(out)
    return out


@pytest.fixture(scope="session")
def stream_data(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``stream_data(name)`` -> a dataset directory, built once per session:
    ``tar`` (203 samples in ~55 shards of 2-4), ``tar_b`` (61 samples, keys ``b*``),
    ``tokens`` (seq_len 8, ~120 sequences in 5 shards)."""
    base = tmp_path_factory.mktemp("stream-data")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            out = str(base / name)
            if name == "tar":
                build_tar_dataset(out, 203)
            elif name == "tar_b":
                build_tar_dataset(out, 61, prefix="b")
            elif name == "tokens":
                build_token_dataset(out, 5, 200, seq_len=8)
            else:
                raise KeyError(name)
            built[name] = out
        return built[name]

    return get


def sample_id(sample: object) -> str:
    """A stable identity for a tar sample dict or a token sequence."""
    if isinstance(sample, dict):
        return str(sample["__key__"])
    return f"t{int(np.asarray(sample).max())}"


def ids_collate(batch: list[object]) -> list[str]:
    return [sample_id(s) for s in batch]
