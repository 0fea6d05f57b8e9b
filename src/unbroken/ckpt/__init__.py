"""Lifeline 2: crash-proof, verified, resumable training state."""

from __future__ import annotations

from unbroken.ckpt.checkpointer import Checkpointer, read_checkpoint
from unbroken.ckpt.state import Stateful, TrainState
from unbroken.ckpt.store import CheckpointInfo, CorruptCheckpoint

__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "CorruptCheckpoint",
    "Stateful",
    "TrainState",
    "read_checkpoint",
]
