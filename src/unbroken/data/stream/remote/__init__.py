"""Remote datasets: shards streamed from object storage through a bounded, order-aware cache
on the node's local disk.

``StreamingDataset("s3://bucket/ds", cache=CacheConfig(cache_dir="/nvme/cache",
cache_limit="200GB"))`` (any fsspec URL) reads ``dataset.json`` remotely and every shard
through one cache (:class:`RemoteCache`) shared by all ranks and DataLoader workers of the
node. Its promises:

* it never holds more than ``cache_limit`` bytes (downloads in flight included);
* nothing unverified is served: every file is checked against ``dataset.json`` before its
  first use (T-NO-WRONG-BYTE), also one found on disk;
* ``cache_dir`` is private to the user (0700 directories, 0600 files, no fixed name
  followed through a symlink: T-SHARED-NODE);
* every wait has a deadline: no progress for ``CacheConfig.timeout`` seconds raises an
  error naming the URL (:class:`RemoteStorageError` when the store stopped answering,
  which the supervisor classifies as a ``storage`` fault).

How (order-aware prefetch, eviction by future use, per-unit locks) and the layout of
``cache_dir``: ARCHITECTURE.md, "Design notes" > data > the remote cache.
"""

from __future__ import annotations

from unbroken.data.stream.remote.cache import (
    RemoteCache,
    RemoteSource,
    check_cache_config,
    fit_cache,
    open_cache,
)
from unbroken.data.stream.remote.events import EVENTS_MAX, read_events
from unbroken.data.stream.remote.fetch import RemoteStorageError, load_remote_manifest
from unbroken.data.stream.remote.probe import NetworkWaitProbe, network_probe

__all__ = [
    "EVENTS_MAX",
    "NetworkWaitProbe",
    "RemoteCache",
    "RemoteSource",
    "RemoteStorageError",
    "check_cache_config",
    "fit_cache",
    "load_remote_manifest",
    "network_probe",
    "open_cache",
    "read_events",
]
