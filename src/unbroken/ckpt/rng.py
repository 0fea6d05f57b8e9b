"""Capture and restore every random number generator a training step touches.

Covered: python ``random``, numpy's global ``RandomState``, numpy ``Generator`` objects the
user registers by name, torch CPU, and every CUDA device when CUDA is initialised.

State dict schema (all values JSON-encodable by :mod:`unbroken.ckpt.codec`)::

    {"python": <random.getstate()>, "numpy": <np.random.get_state(legacy=False)>,
     "numpy_generators": {name: <bit_generator.state>}, "torch": <uint8 tensor>,
     "cuda": [<uint8 tensor per device>]}

RNG state is per process (per rank). When the world size changes on resume the saved
per-rank streams no longer map to ranks, so :func:`derive` re-seeds every generator from
``(seed, rank, step)`` instead: deterministic, documented, and the same on every restart.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["RNGState", "capture", "derive", "restore"]

log = logging.getLogger(__name__)


def _cuda_ready() -> bool:
    # Only touch CUDA when the program already uses it: capturing must not initialise a
    # device context (slow, and wrong in a CPU-only job on a GPU host).
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture(generators: Mapping[str, np.random.Generator] | None = None) -> dict[str, Any]:
    """Snapshot all generators. Cheap: a few KiB, no device sync beyond CUDA's RNG read."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "numpy_generators": {k: g.bit_generator.state for k, g in (generators or {}).items()},
        "torch": torch.get_rng_state(),
    }
    if _cuda_ready():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(
    state: Mapping[str, Any], generators: Mapping[str, np.random.Generator] | None = None
) -> None:
    """Put every generator back exactly where :func:`capture` saw it."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    saved = state.get("numpy_generators", {})
    for name, g in (generators or {}).items():
        if name not in saved:
            raise ValueError(
                f"numpy generator {name!r} is registered but the checkpoint has none of that "
                f"name (it has {sorted(saved)}); register the same generators as when saving"
            )
        g.bit_generator.state = saved[name]
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if len(cuda) != n:
            log.warning(
                "checkpoint holds CUDA RNG state for %d devices, this process sees %d; "
                "restoring the first %d",
                len(cuda),
                n,
                min(n, len(cuda)),
            )
        torch.cuda.set_rng_state_all(list(cuda)[:n])


def _seed64(*parts: object) -> int:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def derive(
    seed: int,
    rank: int,
    step: int,
    generators: Mapping[str, np.random.Generator] | None = None,
) -> None:
    """Re-seed every generator from ``(seed, rank, step)`` (used when world size changed)."""
    s = _seed64("unbroken-rng", seed, rank, step)
    random.seed(s)
    np.random.seed(s % (2**32))
    for name, g in (generators or {}).items():
        g.bit_generator.state = type(g.bit_generator)(_seed64(s, name)).state
    torch.manual_seed(s)  # also seeds every CUDA device


RNGState = dict[str, Any]
