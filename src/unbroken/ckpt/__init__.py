"""Lifeline 2: crash-proof, verified, resumable training state."""

from __future__ import annotations

from unbroken.ckpt.checkpointer import Checkpointer
from unbroken.ckpt.config import ArchiveConfig, CheckpointConfig
from unbroken.ckpt.state import Stateful, TrainState
from unbroken.ckpt.store import CheckpointInfo, CorruptCheckpoint, RestoreRefused
from unbroken.ckpt.verify import read_checkpoint

__all__ = [
    "ArchiveConfig",
    "CheckpointConfig",
    "CheckpointInfo",
    "Checkpointer",
    "CorruptCheckpoint",
    "RestoreRefused",
    "Stateful",
    "TrainState",
    "read_checkpoint",
]
