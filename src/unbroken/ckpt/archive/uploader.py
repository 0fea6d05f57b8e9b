"""Background uploads of committed checkpoints to an :class:`~unbroken.ckpt.archive.remote.Archive`.

Training never waits for the archive and never sees its errors: uploads run on one thread,
failures are logged and kept, and when uploads fall behind the oldest waiting step is
skipped (a newer checkpoint supersedes it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from unbroken.ckpt.archive.io import LocalSnapshot
from unbroken.ckpt.config import ArchiveConfig
from unbroken.common.config import configure

if TYPE_CHECKING:
    from unbroken.ckpt.archive.remote import Archive

__all__ = ["BackgroundUploader"]

log = logging.getLogger(__name__)


class BackgroundUploader:
    """Uploads committed steps on one background thread; the caller never waits or raises.

    :meth:`submit` opens the step's files (so local retention may delete the directory at
    once) and queues it. Each file is retried by the :class:`Archive`; a step that still
    fails is logged at WARNING and kept in :attr:`errors`, and training goes on. When uploads
    fall behind, at most ``max_pending`` steps wait: the oldest waiting one is skipped (newer
    checkpoints supersede it), logged and kept in :attr:`skipped`. After each upload, remote
    retention runs when ``keep_last`` is set. ``max_pending``, ``keep_last`` and
    ``keep_every`` are the :class:`~unbroken.ckpt.ArchiveConfig` fields of the same names,
    taken from ``archive.config``; keyword ``overrides`` change fields of it, by name.
    """

    def __init__(self, archive: Archive, **overrides: Any) -> None:
        self.config = configure(
            ArchiveConfig, archive.config, overrides, owner="BackgroundUploader"
        )
        self.archive = archive
        self.errors: list[Exception] = []
        self.uploaded: list[int] = []
        self.skipped: list[int] = []
        self._pending: collections.deque[LocalSnapshot] = collections.deque()
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"unbroken-archive-{archive.url}", daemon=True
        )
        self._thread.start()

    def submit(self, step_dir: str, step: int) -> None:
        """Queue committed ``step_dir`` for upload; returns at once and never raises for a
        storage problem (a closed uploader is a programming error and does raise)."""
        if self._closed:
            raise RuntimeError("BackgroundUploader.submit() after close()")
        try:
            snap = LocalSnapshot(step_dir, step, self.archive.url)
        except Exception as e:  # noqa: BLE001 - reported, never raised into the loop
            self._report(step, e)
            return
        dropped: LocalSnapshot | None = None
        with self._cv:
            if len(self._pending) >= self.config.max_pending:
                dropped = self._pending.popleft()
                self.skipped.append(dropped.step)
            self._pending.append(snap)
            self._cv.notify_all()
        if dropped is not None:
            dropped.close()
            log.warning(
                "archive %s: skipping upload of step %d, superseded by step %d (uploads are "
                "slower than checkpoints; archive less often)",
                self.archive.url,
                dropped.step,
                step,
            )

    def _report(self, step: int, e: Exception) -> None:
        with self._cv:
            self.errors.append(e)
        log.warning(
            "archive %s: upload of step %d failed: %s; training continues, the next archived "
            "step will try again",
            self.archive.url,
            step,
            e,
        )

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if not self._pending:
                    return
                snap = self._pending.popleft()
                self._busy = True
            try:
                self.archive._upload(snap)
                with self._cv:
                    self.uploaded.append(snap.step)
                if self.config.keep_last is not None:
                    self.archive.prune(self.config.keep_last, self.config.keep_every)
            except Exception as e:  # noqa: BLE001 - reported, never raised into the loop
                self._report(snap.step, e)
            finally:
                snap.close()
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload finished; False when ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self._thread.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued uploads (up to ``timeout`` seconds) and stop the thread. Returns
        whether everything queued was uploaded or reported; idempotent."""
        drained = self.flush(timeout)
        with self._cv:
            self._closed = True
            left = list(self._pending)
            self._pending.clear()
            self._cv.notify_all()
        for snap in left:
            snap.close()
            log.warning(
                "archive %s: step %d was never uploaded (closed before its turn)",
                self.archive.url,
                snap.step,
            )
        self._thread.join(timeout)
        return drained and not left
