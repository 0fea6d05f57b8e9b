"""Lifeline 1: storage -> GPU memory (shards, tokens, staging, order, dataset, loader)."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # the type checker sees what __getattr__ resolves at run time
    from unbroken.data.diagnose.timer import StepTimer
    from unbroken.data.feed.prefetch import DevicePrefetcher
    from unbroken.data.prepare.pack import index_directory, pack
    from unbroken.data.prepare.stage import stage
    from unbroken.data.stream.config import CacheConfig, DatasetConfig, LoaderConfig
    from unbroken.data.stream.dataset import Source, StreamingDataset
    from unbroken.data.stream.loader import StatefulLoader
    from unbroken.data.stream.order import EpochOrder
    from unbroken.data.tokens.flat import index_flat, read_vocab_size
    from unbroken.data.tokens.tokenizer import tokenize


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
