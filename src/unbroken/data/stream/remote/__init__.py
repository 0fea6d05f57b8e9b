"""Remote datasets: shards streamed from object storage through a bounded, order-aware cache
on the node's local disk.

``StreamingDataset("s3://bucket/ds", cache=CacheConfig(cache_dir="/nvme/cache",
cache_limit="200GB"))`` (any fsspec URL) reads ``dataset.json`` remotely and every shard
through one cache shared by all ranks and DataLoader workers of the node:

* **Order-aware prefetch.** The epoch order is a pure function of (fingerprint, seed, epoch),
  so the plan of an epoch - where each shard is read - is known before it starts
  (:mod:`.plan`); the units a position needs and the next ``prefetch_shards`` are fetched in
  parallel threads (:mod:`.pool`), by one fetcher process per node and dataset
  (:mod:`.fetcher`), through the request path (:mod:`.fetch`: ranged GETs, every file checked
  against ``dataset.json`` before it is published).
* **A bounded cache evicted by future use.** The cache never holds more than ``cache_limit``
  bytes, downloads in flight (reserved before their first byte) and its own files included;
  to make room, the unit read farthest in the future goes first, and a unit may only evict
  units needed later than itself (:mod:`.units`, :mod:`.index`).
* **Per-unit locks, robust to a dying process** (:mod:`.locks`): a unit is fetched once at a
  time, an open one is never evicted, and the kernel drops the locks of a process that dies.
* **Nothing unverified is served.** A unit found on disk (left by a job whose index was lost,
  or changed after it was verified) is checked against the whole-file checksums of
  ``dataset.json`` before any sample is read from it.

Layout of ``cache_dir`` (private to the user: 0700 directories, 0600 files, every fixed name
opened without following a symlink; several datasets may share it and its limit)::

    .lock               flock'ed around every read-modify-write of .index
    .index              the units (see :mod:`.index`)
    .events(.1)         the event log (see :mod:`.events`)
    .locks/<dir>-<n>    per-unit lock file (empty; its mtime is a download's heartbeat)
    .readers/<pid>-<k>  each reader's position (see :mod:`.readers`)
    .stats/<pid>        per rank process: its readers' network wait (see :mod:`.probe`)
    .fetch/<id>.lock    held by the dataset's fetcher process (.log: its log)
    <dir>/dataset.json  the manifest (dir = the first 16 hex digits of its fingerprint)
    <dir>/<files>       verified shard and index files; ``.tmp-*`` are downloads in flight

Every wait has a deadline: a download, or the cache, that makes no progress for
``CacheConfig.timeout`` seconds raises an error naming the URL (a :class:`RemoteStorageError`
when the store stopped answering, which the supervisor classifies as a ``storage`` fault).
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
