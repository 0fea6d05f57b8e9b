"""Data builders for the streaming-dataset tests (tar via the real packer, token shards via
the real TokenShardWriter) - small, deterministic, identity-carrying.

A plain module, not a conftest: ``from conftest import ...`` is ambiguous once a
sub-directory has its own conftest.py (tests/drill does)."""

from __future__ import annotations

import os

import numpy as np

# Environment for moto's S3 server and the clients that talk to it (never a real account).
S3_TEST_CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def build_tar_dataset(out: str, n: int, *, prefix: str = "s", shard_size: int = 12_000) -> str:
    """``n`` samples keyed ``<prefix><i:05d>`` with a 300-700 byte payload, 2-4 per shard."""
    from unbroken.data.prepare.pack import pack  # lazily: imported by every test session

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
    out: str,
    shards: int,
    tokens_per_shard: int,
    *,
    seq_len: int,
    doc_len: int = 37,
    block_tokens: int | None = None,
) -> str:
    """Token ids count up from 1 across the dataset (EOS = 0 between documents), so the
    largest id of a sequence identifies it uniquely."""
    from unbroken.data.manifest import DatasetManifest
    from unbroken.data.tokens.shard import TokenShardWriter

    os.makedirs(out, exist_ok=True)
    infos = []
    nxt = 1
    for s in range(shards):
        name = f"tokens-{s:06d}.bin"
        kw = {} if block_tokens is None else {"block_tokens": block_tokens}
        w = TokenShardWriter(os.path.join(out, name), "uint32", 0, fsync=False, **kw)
        left = tokens_per_shard
        while left > 0:
            k = min(doc_len, left)
            w.add(np.arange(nxt, nxt + k))
            nxt += k
            left -= k + 1
        infos.append(w.commit_info(seq_len))
    DatasetManifest.create("tokens", infos, dtype="uint32", eos_id=0, seq_len=seq_len).save(out)
    return out


def sample_id(sample: object) -> str:
    """A stable identity for a tar sample dict or a token sequence."""
    if isinstance(sample, dict):
        return str(sample["__key__"])
    return f"t{int(np.asarray(sample).max())}"


def ids_collate(batch: list[object]) -> list[str]:
    return [sample_id(s) for s in batch]
