"""Lifeline 1: storage -> GPU memory (shards, tokens, staging, order, dataset, loader)."""

from __future__ import annotations

# data preparation (pack / index / tokenize / stage) and readers
from unbroken.data.manifest import DatasetManifest, ManifestError, ShardInfo
from unbroken.data.shards import ShardError, ShardReader
from unbroken.data.tokens import TokenShard

__all__ = [
    # data preparation
    "DatasetManifest",
    "ManifestError",
    "ShardError",
    "ShardInfo",
    "ShardReader",
    "TokenShard",
]
