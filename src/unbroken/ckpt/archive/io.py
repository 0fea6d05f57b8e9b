"""The local side of archive transfers (see :mod:`unbroken.ckpt.archive.remote`): the error type,
a committed checkpoint held open by file descriptor, manifest checks, a parallel runner."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from unbroken.ckpt.manifest import MANIFEST, CheckpointManifest, ManifestError

__all__ = ["ArchiveError", "Damaged", "LocalSnapshot", "SourceFile", "parse_manifest"]

log = logging.getLogger(__name__)


class ArchiveError(RuntimeError):
    """A remote archive operation failed for good.

    ``damaged`` is True when the remote (or local) *data* is wrong (checksum, size, missing
    object, bad manifest): an older step may still be fine. It is False for I/O failures
    that outlived every retry (unreachable storage, missing bucket, permissions).
    """

    def __init__(self, url: str, file: str, reason: str, *, damaged: bool = False) -> None:
        super().__init__(f"archive {url}: {file}: {reason}")
        self.url = url
        self.file = file
        self.reason = reason
        self.damaged = damaged


class Damaged(Exception):
    """Internal: a data problem no retry can fix."""


@dataclass
class SourceFile:
    name: str
    fd: int
    size: int
    checksum: str


class LocalSnapshot:
    """A committed local checkpoint held open by file descriptor.

    Opening every file up front (microseconds, in the caller's thread) lets local retention
    delete the directory while a background upload still reads it: POSIX keeps unlinked data
    alive while a descriptor is open, so local retention never waits for an upload.
    """

    def __init__(self, step_dir: str, step: int, url: str) -> None:
        self.step = step
        self.step_dir = step_dir
        self.sources: list[SourceFile] = []
        mpath = os.path.join(step_dir, MANIFEST)
        try:
            with open(mpath, "rb") as mf:
                self.manifest_bytes = mf.read()
        except FileNotFoundError as e:
            raise ArchiveError(
                url,
                mpath,
                "no manifest.json: only committed checkpoints can be archived",
                damaged=True,
            ) from e
        self.manifest = parse_manifest(self.manifest_bytes, step, url, mpath)
        try:
            for name, f in sorted(self.manifest.files.items()):
                path = os.path.join(step_dir, name)
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError as e:
                    if e.errno not in (errno.ENOENT, errno.ELOOP):
                        raise
                    raise ArchiveError(
                        url,
                        path,
                        f"listed in the manifest but {'a symlink' if e.errno == errno.ELOOP else 'missing'}"
                        " locally; the local checkpoint is damaged and is not archived",
                        damaged=True,
                    ) from e
                self.sources.append(SourceFile(name, fd, f.size, f.checksum))
                size = os.fstat(fd).st_size
                if size != f.size:
                    raise ArchiveError(
                        url,
                        path,
                        f"local file has {size} bytes, manifest says {f.size}; "
                        "the local checkpoint is damaged and is not archived",
                        damaged=True,
                    )
        except BaseException:
            self.close()
            raise
        listed = {s.name for s in self.sources} | {MANIFEST}
        extra = sorted(set(_local_files(step_dir)) - listed)
        if extra:
            log.warning(
                "%s holds files not listed in its manifest; they are not archived: %s",
                step_dir,
                ", ".join(extra[:5]),
            )

    def close(self) -> None:
        for s in self.sources:
            with contextlib.suppress(OSError):
                os.close(s.fd)
        self.sources = []


def _local_files(d: str) -> Iterator[str]:
    for base, _, names in os.walk(d):
        for n in names:
            yield os.path.relpath(os.path.join(base, n), d).replace(os.sep, "/")


def parse_manifest(raw: bytes, step: int, url: str, where: str) -> CheckpointManifest:
    """The manifest of ``step``, validated in full (:class:`CheckpointManifest`); a bad one
    is a damaged copy (:class:`ArchiveError` with ``damaged=True``)."""
    try:
        return CheckpointManifest.from_json(raw, step=step, where=where)
    except ManifestError as e:
        raise ArchiveError(url, where, str(e), damaged=True) from e
