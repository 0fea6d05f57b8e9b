"""What can be configured about checkpointing: ``CheckpointConfig`` and ``ArchiveConfig``.

These two frozen dataclasses are the one place the defaults live. ``Checkpointer`` takes a
``CheckpointConfig`` and, as keywords, fields of it to change (:func:`configured`);
``Archive`` and ``BackgroundUploader`` read an ``ArchiveConfig``. Bad values are refused
here, once, with the option, the value and the fix::

    cfg = CheckpointConfig(every_steps=500, keep_last=3, async_save=True,
                           archive=ArchiveConfig("s3://bucket/run", every=4))
    ckpt = Checkpointer("run/ckpt", state, cfg)
    ckpt = Checkpointer("run/ckpt", state, every_steps=500, keep_last=3)  # the same, inline
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from unbroken.common.config import check_count, check_flag, check_seconds
from unbroken.common.fs import path_str

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["ArchiveConfig", "CheckpointConfig"]

C = TypeVar("C", bound="DataclassInstance")


@dataclass(frozen=True)
class ArchiveConfig:
    """Remote copies of committed checkpoints through the object-store layer (see
    :mod:`.archive.remote`).

    Uploads run in the background and never stop training; a restore that finds no valid
    local checkpoint downloads the newest verified remote one.
    """

    url: str
    """archive root: ``s3://bucket/prefix``, ``gs://``, ``az://``, ``file:///mnt/x``, ``memory://x``."""
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, hash=False)
    """s3fs-style options (endpoint, credentials), mapped to obstore; kept out of repr (secrets)."""
    every: int = 1
    """upload every K-th committed checkpoint (count of commits; 1 uploads each one)."""
    keep_last: int | None = None
    """remote retention: uploaded steps to keep (count); None keeps every upload."""
    keep_every: int | None = None
    """with ``keep_last``: also keep every step divisible by this forever (steps)."""
    retries: int = 3
    """extra attempts per file after the first fails (count); waits double each time."""
    backoff_s: float = 0.5
    """first wait between attempts (seconds), then ``backoff_s * 2**attempt``."""
    threads: int = 8
    """parallel transfers (count): object stores reward concurrency."""
    max_pending: int = 2
    """steps waiting for upload (count); when uploads fall behind the oldest is skipped."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(
                f"ArchiveConfig.url={self.url!r} must be a non-empty URL string, e.g. "
                "'s3://bucket/run'"
            )
        if not isinstance(self.storage_options, Mapping):
            raise ValueError(
                f"ArchiveConfig.storage_options={self.storage_options!r} must be a mapping of "
                "storage options, e.g. {'client_kwargs': {'endpoint_url': ...}}"
            )
        # a copy: the caller's dict changing later must not change a frozen config
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        own = "ArchiveConfig"
        check_count(own, "every", self.every)
        check_count(own, "keep_last", self.keep_last, none="keep every upload")
        check_count(own, "keep_every", self.keep_every, none="no extra steps kept")
        check_count(own, "retries", self.retries, least=0)
        check_count(own, "threads", self.threads)
        check_count(own, "max_pending", self.max_pending)
        check_seconds(own, "backoff_s", self.backoff_s)


@dataclass(frozen=True)
class CheckpointConfig:
    """How a :class:`~unbroken.ckpt.Checkpointer` saves, keeps and restores checkpoints."""

    every_steps: int | None = None
    """``maybe_save()`` saves when ``step % every_steps == 0`` (optimizer steps); None: no step trigger."""
    every_seconds: float | None = None
    """... or once this many seconds passed since the last save (wall clock; any rank's); None: no timer."""
    keep_last: int | None = 3
    """committed checkpoints kept locally (count); 3 = the newest plus two fall-backs; None keeps all."""
    keep_every: int | None = None
    """also keep every step divisible by this forever (steps); None: only ``keep_last``."""
    allow_fresh_start: bool = False
    """start from scratch when the root holds files but no valid checkpoint (off: never silently restart)."""
    async_save: bool = False
    """write in a background thread; ``save()`` blocks only for the copy into host buffers."""
    io_threads: int = 2
    """parallel writer threads per rank (count; DCP's ``thread_count``)."""
    direct_io: bool = True
    """write the data files with ``O_DIRECT``, past the page cache (page cache where the filesystem refuses it); False: through the page cache, a restore right after reads it warm."""
    save_on_sigterm: bool = False
    """on SIGTERM (preemption) the next ``maybe_save()`` saves synchronously and exits 143."""
    distributed: bool | None = None
    """None: collective when torch.distributed is initialised; False: this process saves alone."""
    archive: ArchiveConfig | None = None
    """remote copies of committed checkpoints (:class:`ArchiveConfig`); None: local only."""
    quiet: bool = False
    """no line on stderr (rank 0) for each restore and fall-back; they go to DEBUG logging."""
    memory_every_steps: int | None = None
    """publish the snapshot to node memory every K steps (steps; 1 allowed): a crash loses <= K; None: off."""
    memory_dir: str | None = None
    """the memory tier's private directory; None: ``$UNBROKEN_MEMORY_TIER``, else ``/dev/shm/unbroken-<uid>/<job>``."""
    memory_replica: bool = True
    """with the memory tier on several nodes: keep a copy of each rank's newest slot on the next node (a node loss loses <= K)."""

    def __post_init__(self) -> None:
        own = "CheckpointConfig"
        check_count(own, "every_steps", self.every_steps, none="no step trigger")
        check_seconds(own, "every_seconds", self.every_seconds, positive=True, none="no timer")
        check_count(own, "keep_last", self.keep_last, none="keep all")
        check_count(own, "keep_every", self.keep_every, none="only keep_last")
        check_count(own, "io_threads", self.io_threads)
        check_count(own, "memory_every_steps", self.memory_every_steps, none="memory tier off")
        object.__setattr__(self, "memory_dir", path_str(self.memory_dir))  # a pathlib.Path too
        if self.memory_dir is not None and (
            not isinstance(self.memory_dir, str) or not self.memory_dir
        ):
            raise ValueError(
                f"CheckpointConfig.memory_dir={self.memory_dir!r} must be a non-empty path or "
                "None (then $UNBROKEN_MEMORY_TIER or /dev/shm/unbroken-<uid>/<job>)"
            )
        for name in (
            "allow_fresh_start",
            "async_save",
            "direct_io",
            "save_on_sigterm",
            "quiet",
            "memory_replica",
        ):
            check_flag(own, name, getattr(self, name))
        check_flag(own, "distributed", self.distributed, none="collective when initialised")
        if self.archive is not None and not isinstance(self.archive, ArchiveConfig):
            raise ValueError(
                f"CheckpointConfig.archive={self.archive!r} must be an ArchiveConfig or None; "
                f"pass archive=ArchiveConfig({self.archive!r})"
            )
