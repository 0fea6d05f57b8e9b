"""unbroken: keep PyTorch training jobs fed and alive.

The everyday names are importable from here; they load lazily, so ``unbroken --help`` and
the data-preparation commands start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unbroken.common.lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "Checkpointer": "unbroken.ckpt",
    "CheckpointConfig": "unbroken.ckpt",
    "TrainState": "unbroken.ckpt",
    "read_checkpoint": "unbroken.ckpt",
    "MetricLog": "unbroken.common.metrics",
    "global_ids": "unbroken.common.metrics",
    "StreamingDataset": "unbroken.data",
    "StatefulLoader": "unbroken.data",
    "LoaderConfig": "unbroken.data",
    "Source": "unbroken.data",
    "DevicePrefetcher": "unbroken.data",
    "StepTimer": "unbroken.data",
    "beat": "unbroken.elastic",
    "finishing": "unbroken.elastic",
}


__getattr__ = lazy_getattr(__name__, _LAZY)

if TYPE_CHECKING:  # the type checker sees what __getattr__ resolves at run time
    from unbroken.ckpt import CheckpointConfig, Checkpointer, TrainState, read_checkpoint
    from unbroken.common.metrics import MetricLog, global_ids
    from unbroken.data import (
        DevicePrefetcher,
        LoaderConfig,
        Source,
        StatefulLoader,
        StepTimer,
        StreamingDataset,
    )
    from unbroken.elastic import beat, finishing


__all__ = [
    "__version__",
    "Checkpointer",
    "CheckpointConfig",
    "TrainState",
    "read_checkpoint",
    "MetricLog",
    "global_ids",
    "StreamingDataset",
    "StatefulLoader",
    "LoaderConfig",
    "Source",
    "DevicePrefetcher",
    "StepTimer",
    "beat",
    "finishing",
]
