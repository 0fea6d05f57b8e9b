"""Lifeline 1: storage -> GPU memory (shards, tokens, staging, order, dataset, loader)."""

from __future__ import annotations

# the formats' readers: light (numpy only)
from unbroken.common.lazy import lazy_getattr
from unbroken.data.manifest import DatasetManifest, ManifestError, ShardInfo
from unbroken.data.tar.reader import ShardError, ShardReader
from unbroken.data.tokens.shard import TokenShard

# preparation and streaming: imported on first use (streaming imports torch, and
# `unbroken data pack` / `unbroken data stage` should start without it)
_LAZY = {
    "pack": "unbroken.data.prepare.pack",
    "index_directory": "unbroken.data.prepare.pack",
    "index_flat": "unbroken.data.tokens.flat",
    "read_vocab_size": "unbroken.data.tokens.flat",
    "stage": "unbroken.data.prepare.stage",
    "CacheConfig": "unbroken.data.stream.config",
    "DatasetConfig": "unbroken.data.stream.config",
    "EpochOrder": "unbroken.data.stream.order",
    "LoaderConfig": "unbroken.data.stream.config",
    "Source": "unbroken.data.stream.dataset",
    "StatefulLoader": "unbroken.data.stream.loader",
    "StreamingDataset": "unbroken.data.stream.dataset",
    "DevicePrefetcher": "unbroken.data.feed.prefetch",
    "StepTimer": "unbroken.data.diagnose.timer",
    "tokenize": "unbroken.data.tokens.tokenizer",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    # streaming and the GPU feed
    "CacheConfig",
    "DatasetConfig",
    "DevicePrefetcher",
    "StepTimer",
    "EpochOrder",
    "LoaderConfig",
    "Source",
    "StatefulLoader",
    "StreamingDataset",
    # data preparation
    "index_directory",
    "index_flat",
    "read_vocab_size",
    "pack",
    "stage",
    "tokenize",
    "DatasetManifest",
    "ManifestError",
    "ShardError",
    "ShardInfo",
    "ShardReader",
    "TokenShard",
]
