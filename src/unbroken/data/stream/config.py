"""What can be configured about the loader: ``LoaderConfig``, the one place its defaults live.

``StatefulLoader`` takes a ``LoaderConfig`` (``config=``) or the same options as keywords;
objects that are code rather than settings (``collate_fn``, ``worker_init_fn``,
``generator``, ``multiprocessing_context``) stay arguments of the loader::

    loader = StatefulLoader(ds, config=LoaderConfig(batch_size=64, num_workers=4, pin_memory=True))
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.common.config import check_choice, check_count, check_flag, check_seconds
from unbroken.data.stream.order import LAST_BATCH_POLICIES

__all__ = ["ON_DATASET_CHANGE", "LoaderConfig"]

ON_DATASET_CHANGE = ("error", "restart_epoch")


@dataclass(frozen=True)
class LoaderConfig:
    """How a :class:`~unbroken.data.StatefulLoader` batches and feeds a dataset.

    None of these changes which samples a rank sees, except ``batch_size`` and
    ``last_batch`` (D-ORDER: the order does not depend on workers or prefetching).
    """

    batch_size: int = 1
    """samples per batch on this rank (count); the global batch is ``batch_size * world_size``."""
    last_batch: str = "pad"
    """the epoch's last, partial global step: ``"pad"`` (repeat first samples: equal, full batches on every rank), ``"drop"``, ``"short"``."""
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

    def __post_init__(self) -> None:
        own = "LoaderConfig"
        check_count(own, "batch_size", self.batch_size)
        check_choice(own, "last_batch", self.last_batch, LAST_BATCH_POLICIES)
        check_choice(own, "on_dataset_change", self.on_dataset_change, ON_DATASET_CHANGE)
        check_count(own, "num_workers", self.num_workers, least=0)
        check_count(own, "prefetch_factor", self.prefetch_factor, none="torch's default")
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError(
                f"LoaderConfig.prefetch_factor={self.prefetch_factor} needs num_workers > 0 "
                "(without workers nothing is prefetched); pass num_workers, or leave "
                "prefetch_factor=None"
            )
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError("LoaderConfig.persistent_workers=True needs num_workers > 0")
        check_seconds(own, "timeout", self.timeout)
        for name in ("pin_memory", "persistent_workers", "shm_transport"):
            check_flag(own, name, getattr(self, name))
        if not isinstance(self.pin_memory_device, str):
            raise ValueError(
                f"LoaderConfig.pin_memory_device={self.pin_memory_device!r} must be a device "
                "string such as 'cuda', or '' (the current accelerator)"
            )
