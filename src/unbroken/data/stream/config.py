"""What can be configured about the data path: one frozen dataclass per component, the one
place its defaults live.

``StreamingDataset(source, config=None, **overrides)`` takes a :class:`DatasetConfig` (which
holds a :class:`CacheConfig` for remote sources), ``StatefulLoader(dataset, config=None,
**overrides)`` a :class:`LoaderConfig`; the keywords are field names of that config, applied
with ``dataclasses.replace`` (an unknown one is a ``TypeError`` listing the fields). Objects
that are code rather than settings (``transform``, ``collate_fn``, ``worker_init_fn``,
``generator``, ``multiprocessing_context``) stay arguments of the component::

    ds = StreamingDataset("/nvme/tok", seed=0, seq_len=1024)
    loader = StatefulLoader(ds, batch_size=64, num_workers=4, pin_memory=True)
    remote = StreamingDataset(
        "s3://bucket/ds", cache=CacheConfig(cache_dir="/nvme/cache", cache_limit="200GB")
    )
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unbroken.common.config import check_choice, check_count, check_flag, check_seconds, parse_size
from unbroken.common.fs import path_str
from unbroken.data.stream.order import LAST_BATCH_POLICIES

__all__ = [
    "ON_CORRUPT",
    "ON_DATASET_CHANGE",
    "WINDOWS",
    "CacheConfig",
    "DatasetConfig",
    "LoaderConfig",
]

ON_DATASET_CHANGE = ("error", "restart_epoch")
ON_CORRUPT = ("raise", "skip")
WINDOWS = ("fixed", "random")


@dataclass(frozen=True)
class CacheConfig:
    """How remote sources (fsspec URLs) are read: through a bounded cache on the node's local
    disk, shared by its ranks and DataLoader workers (:mod:`unbroken.data.stream.remote`)."""

    cache_dir: str | None = None
    """local directory of the node's cache (needed for a remote source); created 0700, refused when other users can write it."""
    cache_limit: int | str | None = None
    """bytes the cache may hold, its own files included ("200GB", "1TiB", an int); None: unbounded."""
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False, hash=False)
    """fsspec options of the remote sources (endpoint, credentials); kept out of repr (secrets)."""
    prefetch_shards: int | None = None
    """shards fetched ahead of the current position, node-wide (count); None: from the window and the limit."""
    prefetch_bytes: int | str | None = None
    """optional cap on the bytes of those prefetched shards ("2GB" or an int); None: no cap."""
    threads: int = 4
    """parallel downloads per downloading process (count); a per-shard lock keeps them apart."""
    timeout: float = 60.0
    """seconds without progress before a reader fails naming the URL; also s3fs's connect/read timeout."""
    retries: int = 3
    """extra attempts per file after a failed transfer or a checksum mismatch (count)."""
    backoff_s: float = 0.5
    """first delay between attempts (seconds); doubles each time."""
    fetch_process: bool = True
    """download in one helper process per node and dataset (a worker busy decoding starves its own threads)."""
    grace_s: float = 2.0
    """seconds a reader waits for the helper process before downloading a shard itself."""

    def __post_init__(self) -> None:
        own = "CacheConfig"
        object.__setattr__(self, "cache_dir", path_str(self.cache_dir))  # a pathlib.Path too
        if self.cache_dir is not None and (
            not isinstance(self.cache_dir, str) or not self.cache_dir
        ):
            raise ValueError(f"{own}.cache_dir={self.cache_dir!r} must be a directory path")
        for name in ("cache_limit", "prefetch_bytes"):
            v = getattr(self, name)
            if v is not None:
                try:
                    object.__setattr__(self, name, parse_size(v))
                except ValueError as e:
                    raise ValueError(f"{own}.{name}={v!r}: {e}") from None
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping):
                raise ValueError(
                    f"{own}.storage_options must be a mapping of fsspec options, e.g. "
                    "{'client_kwargs': {'endpoint_url': ...}}"
                )
            # a copy: the caller's dict changing later must not change a frozen config
            object.__setattr__(self, "storage_options", dict(self.storage_options))
        for name, least in (("prefetch_shards", 0), ("threads", 1), ("retries", 0)):
            v = getattr(self, name)
            if v is None and name == "prefetch_shards":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{own}.{name}={v!r} must be >= {least} (an integer)")
        for name in ("timeout", "backoff_s", "grace_s"):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
            if not ok or v < 0 or (name == "timeout" and v == 0) or v == float("inf"):
                bound = "> 0" if name == "timeout" else ">= 0"
                raise ValueError(f"{own}.{name}={v!r} must be {bound} seconds (a finite number)")
        check_flag(own, "fetch_process", self.fetch_process)

    @property
    def limit_bytes(self) -> int | None:
        """``cache_limit`` in bytes."""
        return None if self.cache_limit is None else parse_size(self.cache_limit)

    @property
    def cap_bytes(self) -> int | None:
        """``prefetch_bytes`` in bytes."""
        return None if self.prefetch_bytes is None else parse_size(self.prefetch_bytes)


@dataclass(frozen=True)
class DatasetConfig:
    """What a :class:`~unbroken.data.StreamingDataset` reads and in which order.

    ``seed``, ``shuffle``, ``shuffle_window``, ``samples_per_epoch`` and ``mix_block`` are
    part of the order (D-ORDER); ``rank`` and ``world_size`` only choose this process's share.
    """

    seed: int = 0
    """shuffle seed (non-negative int); with the fingerprint and the epoch it fixes the order."""
    shuffle: bool = True
    """False reads every epoch in manifest order."""
    shuffle_window: int | None = None
    """samples per shuffle window (8 bytes each per worker); None: 4x the largest shard, >= 256 Ki, <= 4 Mi."""
    seq_len: int | None = None
    """token datasets: tokens per sequence (a sample is seq_len + 1 tokens); None: as tokenized."""
    windows: str = "fixed"
    """token datasets: "fixed" cuts sample i at token i*seq_len (each token once an epoch); "random" starts each sample at a uniform token offset (nanoGPT's get_batch), drawn from (seed, epoch, position): resumes exactly."""
    rank: int | None = None
    """this process's rank; None (with world_size None): from torch.distributed, else 0."""
    world_size: int | None = None
    """ranks sharing the epoch; None (with rank None): from torch.distributed, else 1."""
    samples_per_epoch: int | None = None
    """mixtures only: positions per epoch (count); None: the sum of the sources' sizes."""
    mix_block: int = 4096
    """mixtures only: slots per mixture block (the smallest weight must get >= 1 slot)."""
    with_ids: bool = False
    """attach each sample's id: batch["__id__"] for dict samples, (sample, id) pairs otherwise."""
    verify: bool = True
    """check every sample's bytes and each shard index against the checksums recorded when written."""
    on_corrupt: str = "raise"
    """a damaged sample: "raise" an error naming dataset, shard, sample and member; "skip" it (counted)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """how remote sources are fetched and cached (cache_dir, cache_limit, storage_options, ...)."""

    def __post_init__(self) -> None:
        own = "DatasetConfig"
        check_count(own, "seed", self.seed, least=0)
        check_flag(own, "shuffle", self.shuffle)
        check_count(own, "shuffle_window", self.shuffle_window, none="the default window")
        check_count(own, "seq_len", self.seq_len, none="as tokenized")
        check_count(own, "samples_per_epoch", self.samples_per_epoch, none="the sources' sizes")
        check_count(own, "mix_block", self.mix_block)
        for name in ("with_ids", "verify"):
            check_flag(own, name, getattr(self, name))
        check_choice(own, "on_corrupt", self.on_corrupt, ON_CORRUPT)
        check_choice(own, "windows", self.windows, WINDOWS)
        if not isinstance(self.cache, CacheConfig):
            raise ValueError(f"{own}.cache={self.cache!r} must be a CacheConfig")
        rank, world = self.rank, self.world_size
        if (rank is None) != (world is None):
            raise ValueError(
                f"{own}.rank={rank} world_size={world}: pass both or neither (neither: taken "
                "from torch.distributed, or 0 and 1 when it is not initialized)"
            )
        if rank is not None and world is not None:
            check_count(own, "world_size", world)
            check_count(own, "rank", rank, least=0)
            if rank >= world:
                raise ValueError(f"{own}.rank={rank} world_size={world}: need rank < world_size")


@dataclass(frozen=True)
class LoaderConfig:
    """How a :class:`~unbroken.data.StatefulLoader` batches and feeds a dataset.

    None of these changes which samples a rank sees, except ``batch_size`` and
    ``last_batch`` (D-ORDER: the order does not depend on workers or prefetching).
    ``last_batch`` is the one spelling of torch's ``drop_last``: ``drop_last=True`` is
    ``last_batch="drop"``, ``drop_last=False`` is ``"short"``.
    """

    batch_size: int = 1
    """samples per batch on this rank (count); the global batch is ``batch_size * world_size``."""
    last_batch: str = "pad"
    """the epoch's last, partial global step: ``"pad"`` (repeat the samples just before it: equal, full batches on every rank), ``"drop"``, ``"short"``."""
    on_dataset_change: str = "error"
    """a resume state saved on another dataset fingerprint: ``"error"`` refuses, ``"restart_epoch"`` restarts that epoch."""
    num_workers: int = 0
    """DataLoader worker processes (count); 0 loads in the training process."""
    prefetch_factor: int | None = None
    """batches each worker prepares ahead (count); None: torch's default (2 with workers)."""
    pin_memory: bool = False
    """deliver batches in page-locked host memory for fast, async host-to-GPU copies."""
    persistent_workers: bool = False
    """keep the workers alive from one epoch to the next (needs ``num_workers > 0``)."""
    timeout: float = 0
    """seconds to wait for a batch from a worker before raising; 0 waits forever."""
    pin_memory_device: str = ""
    """device whose pinned memory to use (as ``DataLoader``); "" means the current accelerator."""
    shm_transport: bool = True
    """workers hand tensors over through reusable shared-memory slots, not torch's pipe (False: for comparisons)."""
    xy: bool = False
    """token datasets: deliver ``(x, y)``, contiguous ``(B, seq_len)`` inputs and targets made in the worker (``targets.view(-1)`` works), instead of ``(B, seq_len + 1)`` rows."""
    held_batches: int = 0
    """batches the training loop holds across a save (nanoGPT's ``X, Y = next(it)`` right after the forward pass: 1); the saved position leaves them unconsumed, so a resume delivers them again."""

    def __post_init__(self) -> None:
        own = "LoaderConfig"
        check_count(own, "batch_size", self.batch_size)
        check_choice(own, "last_batch", self.last_batch, LAST_BATCH_POLICIES)
        check_choice(own, "on_dataset_change", self.on_dataset_change, ON_DATASET_CHANGE)
        check_count(own, "num_workers", self.num_workers, least=0)
        check_count(own, "prefetch_factor", self.prefetch_factor, none="torch's default")
        check_seconds(own, "timeout", self.timeout)
        for name, default, why in (
            ("prefetch_factor", None, "without workers nothing is prefetched"),
            ("persistent_workers", False, "there are no workers to keep"),
            ("timeout", 0, "it bounds the wait for a worker's batch"),
        ):
            if getattr(self, name) != default and self.num_workers == 0:
                raise ValueError(
                    f"LoaderConfig.{name}={getattr(self, name)!r} needs num_workers > 0 ({why}); "
                    f"pass num_workers, or leave {name}={default!r}"
                )
        check_count(own, "held_batches", self.held_batches, least=0)
        for name in ("pin_memory", "persistent_workers", "shm_transport", "xy"):
            check_flag(own, name, getattr(self, name))
        if not isinstance(self.pin_memory_device, str):
            raise ValueError(
                f"LoaderConfig.pin_memory_device={self.pin_memory_device!r} must be a device "
                "string such as 'cuda', or '' (the current accelerator)"
            )
