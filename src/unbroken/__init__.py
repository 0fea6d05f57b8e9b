"""unbroken: keep PyTorch training jobs fed and alive.

The everyday names are importable from here; they load lazily, so ``unbroken --help`` and
the data-preparation commands start without importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Checkpointer": "unbroken.ckpt",
    "TrainState": "unbroken.ckpt",
    "read_checkpoint": "unbroken.ckpt",
    "MetricLog": "unbroken.metrics",
    "StreamingDataset": "unbroken.data",
    "StatefulLoader": "unbroken.data",
    "Source": "unbroken.data",
    "DevicePrefetcher": "unbroken.data",
    "StepTimer": "unbroken.data",
    "beat": "unbroken.elastic",
}


def __getattr__(name: str) -> object:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)


__all__ = ["__version__", *_LAZY]
