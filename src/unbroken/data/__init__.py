"""Lifeline 1: storage -> GPU memory (shards, tokens, staging, order, dataset, loader)."""

from __future__ import annotations

# data preparation (pack / index / tokenize / stage) and readers. `pack` and `stage` share
# their submodule's name, so they are imported from it: `from unbroken.data.pack import pack`.
from unbroken._lazy import lazy_getattr
from unbroken.data.manifest import DatasetManifest, ManifestError, ShardInfo
from unbroken.data.shards import ShardError, ShardReader
from unbroken.data.tokens import TokenShard

# streaming (order, dataset, loader): imported on first use, because they import torch and
# `unbroken pack` / `unbroken stage` should start without it
_LAZY = {
    "CacheOptions": "unbroken.data.cache",
    "EpochOrder": "unbroken.data.order",
    "Source": "unbroken.data.dataset",
    "StatefulLoader": "unbroken.data.loader",
    "StreamingDataset": "unbroken.data.dataset",
    "DevicePrefetcher": "unbroken.data.prefetch",
    "StepTimer": "unbroken.data.profile",
    "tokenize": "unbroken.data.tokenizing",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    # streaming and the GPU feed
    "CacheOptions",
    "DevicePrefetcher",
    "StepTimer",
    "EpochOrder",
    "Source",
    "StatefulLoader",
    "StreamingDataset",
    # data preparation
    "tokenize",
    "DatasetManifest",
    "ManifestError",
    "ShardError",
    "ShardInfo",
    "ShardReader",
    "TokenShard",
]
