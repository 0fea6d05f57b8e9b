"""On-disk layout, the commit protocol, listing, quarantine and retention.

Layout under a checkpoint root::

    <root>/
      step-00000100/              a committed checkpoint (visible only once complete)
        manifest.json             written last: format, step, files (size + checksum),
                                  tensors (dtype, shape, sum, norm, location), counters ...
        .metadata                 DCP metadata (DCP's own tools read the directory)
        __0_0.distcp ...          DCP tensor data, one or more files per rank
        state-rank0.json          pickle-free non-tensor state of rank 0
      .tmp-step-00000200.ab12cd34 a save in progress, or debris of a killed one
      corrupt-step-00000300-checksum   quarantined by restore(); never deleted by us

Commit protocol (C-ATOMIC): write everything into a temporary sibling, fsync each file,
write ``manifest.json`` last and fsync it, fsync the directory, ``rename`` it to
``step-N`` (atomic on POSIX), fsync the root. A SIGKILL at any instant leaves either the
old set of committed steps or the old set plus the new one.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from unbroken.ckpt.bounds import MAX_MANIFEST, Budget
from unbroken.ckpt.lock import LOCK_NAME, note_temp
from unbroken.ckpt.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointManifest,
    ManifestError,
)
from unbroken.common.errors import CheckFailed
from unbroken.common.fs import atomic_write_bytes, fsync_dir, is_remote, local_path
from unbroken.common.text import printable

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointInfo",
    "CorruptCheckpoint",
    "RestoreRefused",
    "Store",
    "step_of",
]

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-([0-9]{8,})$")
_TMP_PREFIX = ".tmp-step-"
_CORRUPT_RE = re.compile(r"^corrupt-step-([0-9]+)-(.+)$")


def step_of(name: str) -> int | None:
    """The step a directory named ``name`` holds, only when :meth:`Store.step_dir` writes
    exactly that name: ``step-9``, a non-ASCII digit or a second spelling of a step are
    someone else's (never two candidates for one step, nor one whose path does not exist)."""
    m = _STEP_RE.match(name)
    step = int(m.group(1)) if m else None
    return step if step is not None and name == f"step-{step:08d}" else None


class CorruptCheckpoint(CheckFailed):
    """A committed checkpoint failed verification; ``reason`` is a short slug. ``detail``
    quotes the files: its control characters are escaped (safe to print or log)."""

    def __init__(self, step: int, reason: str, detail: str) -> None:
        detail = printable(detail)
        super().__init__(f"step {step}: {reason}: {detail}")
        self.step = step
        self.reason = reason
        self.detail = detail


class RestoreRefused(ValueError):
    """An intact checkpoint that the live state cannot take: other components, keys, shapes
    or dtypes, per-rank state that cannot follow a world-size change, a component whose own
    ``load_state_dict`` refuses every checkpoint. Deterministic: restarting the same job
    refuses again, so a supervisor stops (a configuration fault) instead of retrying. The
    message names what differs and the fix, escaped; nothing was restored or moved aside.
    ``step``: the checkpoint refused (None when not known)."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    size: int
    mtime: float


class Store:
    """A checkpoint root directory: names, commit, listing, quarantine, retention."""

    def __init__(self, root: str) -> None:
        if is_remote(root):
            raise ValueError(
                f"checkpoint root {root!r} is a remote URL; write checkpoints to a local or "
                "shared filesystem path and use archive='s3://...' for remote copies"
            )
        self.root = os.path.abspath(local_path(root))

    # --- names --------------------------------------------------------------------------

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step:08d}")

    def ensure_root(self) -> None:
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)  # private when ours (T-SHARED-NODE)
        except OSError as e:
            raise RuntimeError(
                f"cannot create checkpoint directory {self.root!r}: {e.strerror}; pass a "
                "writable path"
            ) from e
        if not os.access(self.root, os.W_OK):
            raise PermissionError(f"checkpoint directory {self.root!r} is not writable")

    # --- listing ------------------------------------------------------------------------

    def _entries(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []
        except NotADirectoryError as e:
            raise ValueError(f"checkpoint root {self.root!r} is a file, not a directory") from e

    def steps(self) -> list[int]:
        """Committed steps, ascending. A ``step-N`` directory counts only with a manifest."""
        out = []
        for name in self._entries():
            step = step_of(name)
            if step is not None and os.path.isfile(os.path.join(self.root, name, MANIFEST)):
                out.append(step)
        return sorted(out)

    def candidates(self) -> list[int]:
        """Every ``step-N`` directory, ascending, committed or not: what restore() and
        ``ckpt verify`` examine (our commit never leaves one without a manifest, so such a
        directory is damage, reported and moved aside like any other)."""
        return sorted(s for n in self._entries() if (s := step_of(n)) is not None)

    def uncommitted(self) -> list[str]:
        """``step-N`` directories without a manifest: never produced by our commit."""
        return sorted(
            n
            for n in self._entries()
            if step_of(n) is not None and not os.path.isfile(os.path.join(self.root, n, MANIFEST))
        )

    def quarantined(self) -> list[tuple[str, int, str]]:
        """What :meth:`quarantine` moved aside, as ``(name, step, reason)``, by name."""
        out = []
        for name in sorted(self._entries()):
            m = _CORRUPT_RE.match(name)
            if m:
                out.append((name, int(m.group(1)), m.group(2)))
        return out

    def temp_dirs(self) -> list[str]:
        return sorted(n for n in self._entries() if n.startswith(_TMP_PREFIX))

    def info(self, step: int) -> CheckpointInfo:
        d = self.step_dir(step)
        size = 0
        for e in os.scandir(d):
            if e.is_file():
                size += e.stat().st_size
        return CheckpointInfo(step, d, size, os.path.getmtime(os.path.join(d, MANIFEST)))

    def file_bytes(self, step: int) -> int:
        """Bytes on disk of the regular files in ``step``'s directory (symlinks not
        followed): what justifies the memory a restore of it may spend
        (:class:`~.bounds.Budget`). A sparse file counts the blocks it holds, not its
        apparent size (a 1 TiB hole would lift the bound to 2 TiB), on a file system that
        reports blocks (some FUSE mounts report none: there, the sizes)."""
        try:
            with os.scandir(self.step_dir(step)) as it:
                sts = [
                    e.stat(follow_symlinks=False) for e in it if e.is_file(follow_symlinks=False)
                ]
        except OSError:
            return 0
        if not any(st.st_blocks for st in sts):
            return sum(st.st_size for st in sts)
        return sum(min(st.st_size, st.st_blocks * 512) for st in sts)

    def has_foreign_content(self) -> bool:
        """True when the root holds anything at all (a sign it was meant to hold checkpoints)."""
        return any(n != LOCK_NAME for n in self._entries())

    # --- manifest -------------------------------------------------------------------------

    def read_manifest(self, step: int, budget: Budget | None = None) -> CheckpointManifest:
        """The fully validated manifest of ``step`` (see :mod:`unbroken.ckpt.manifest`);
        raises :class:`CorruptCheckpoint` naming what is wrong. Opens nothing else.
        ``budget``: what parsing may cost (default: what the step directory's files justify,
        :mod:`unbroken.ckpt.bounds`)."""
        d = self.step_dir(step)
        path = os.path.join(d, MANIFEST)
        try:
            if stat.S_ISLNK(os.lstat(d).st_mode):
                raise CorruptCheckpoint(
                    step, "symlink", f"{d} is a symlink; checkpoints must lie in the root"
                )
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError as e:
            raise CorruptCheckpoint(
                step,
                "no-manifest",
                f"{path} is missing (deleted, or the directory was not written by unbroken)",
            ) from e
        except OSError as e:
            raise CorruptCheckpoint(
                step, "symlink" if e.errno == errno.ELOOP else "bad-manifest", f"{path}: {e}"
            ) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpoint(step, "bad-manifest", f"{path} is not a manifest file")
            if st.st_size > MAX_MANIFEST:
                raise CorruptCheckpoint(
                    step, "too-large", f"{path} is {st.st_size} bytes, above the "
                    f"{MAX_MANIFEST >> 20} MiB cap on a manifest"
                )  # fmt: skip
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_MANIFEST + 1)
        finally:
            os.close(fd)
        if budget is None:
            budget = Budget(self.file_bytes(step))
        try:
            return CheckpointManifest.from_json(raw, step=step, where=path, budget=budget)
        except ManifestError as e:
            raise CorruptCheckpoint(step, e.reason, str(e)) from e

    # --- commit ---------------------------------------------------------------------------

    def begin(self, step: int) -> str:
        self.ensure_root()
        tmp = os.path.join(self.root, f"{_TMP_PREFIX}{step:08d}.{uuid.uuid4().hex[:8]}")
        note_temp(tmp)  # before it exists: a restore in another thread must never take it
        os.mkdir(tmp, 0o700)
        return tmp

    def commit(self, tmp: str, step: int, manifest: CheckpointManifest) -> str:
        """Write the manifest last, fsync, and atomically publish ``tmp`` as ``step-N``."""
        atomic_write_bytes(os.path.join(tmp, MANIFEST), manifest.to_json())
        fsync_dir(tmp)
        final = self.step_dir(step)
        if os.path.exists(final):
            raise FileExistsError(f"checkpoint {final} already exists; refusing to overwrite it")
        os.rename(tmp, final)
        note_temp(tmp, done=True)
        fsync_dir(self.root)
        return final

    def abort(self, tmp: str) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        note_temp(tmp, done=True)

    # --- damage -----------------------------------------------------------------------------

    def quarantine(self, step: int, reason: str) -> str | OSError:
        """Move damaged ``step`` aside as ``corrupt-step-N-<reason>`` (never deleted).
        Returns the new path, or the error when the directory cannot be renamed (a
        read-only file system, no permission): the caller skips the step instead."""
        src = self.step_dir(step)
        dst = os.path.join(self.root, f"corrupt-step-{step:08d}-{reason}")
        if os.path.lexists(dst):
            dst = f"{dst}.{int(time.time())}"
        try:
            os.rename(src, dst)
            fsync_dir(self.root)
        except OSError as e:
            return e
        return dst

    def remove_debris(self, is_stale: Callable[[str], bool] | None = None) -> list[str]:
        """Delete temp directories left by killed saves (never visible as checkpoints), those
        for which ``is_stale(path)`` holds (default: all). Logs what was removed and, once,
        what could not be (e.g. a read-only file system); returns the removed names."""
        removed: list[str] = []
        failed: list[str] = []
        for name in self.temp_dirs():
            path = os.path.join(self.root, name)
            if is_stale is not None and not is_stale(path):
                continue  # e.g. a live save, or one whose writer we cannot know is gone
            shutil.rmtree(path, ignore_errors=True)
            (failed if os.path.lexists(path) else removed).append(name)
        if removed:
            log.warning(
                "removed %d stale temporary checkpoint dir(s) left by an interrupted save: %s",
                len(removed),
                ", ".join(removed),
            )
        if failed:
            log.warning(
                "could not delete %d stale temporary checkpoint dir(s) in %s (read-only or no "
                "permission): %s; they are never read as checkpoints",
                len(failed),
                self.root,
                ", ".join(failed),
            )
        return removed

    # --- retention ----------------------------------------------------------------------------

    def prune(
        self,
        keep_last: int | None,
        keep_every: int | None,
        protect: Iterable[int],
        remove: Callable[[str], object] | None = None,
    ) -> list[int]:
        """Delete committed steps beyond ``keep_last`` except multiples of ``keep_every`` and
        ``protect``. Only ``step-N`` directories are touched; foreign files never are. Each
        leaves the committed set at once (renamed aside); ``remove(path)`` then deletes the
        renamed directory (default: here and now; the Checkpointer's runs on a thread)."""
        if keep_last is None:
            return []
        steps = self.steps()
        keep = set(steps[-keep_last:]) | set(protect)
        if keep_every:
            keep |= {s for s in steps if s % keep_every == 0}
        gone = [s for s in steps if s not in keep]
        for s in gone:
            # Rename first so a kill mid-delete never leaves a half-deleted "committed" step;
            # a name of its own, so no entry left there (debris, a file) is in the way.
            doomed = os.path.join(
                self.root, f"{_TMP_PREFIX}{s:08d}.deleting.{uuid.uuid4().hex[:8]}"
            )
            os.rename(self.step_dir(s), doomed)
            if remove is None:
                shutil.rmtree(doomed, ignore_errors=True)
            else:
                remove(doomed)
        if gone:
            fsync_dir(self.root)
        return gone
