"""Where a job's memory tier lives on a node, and its lifetime (issue 25).

``/dev/shm/unbroken-<uid>/<job>``: a private directory on tmpfs (0700, this user's, no
symlink; :func:`~unbroken.common.fs.private_dir`), whose files outlive the process that
wrote them. ``<job>`` is a hash of a key naming the job (the checkpoint root's real path
without ``unbroken run``; the run directory and run id under it), so two jobs of one user
never share a directory and a restarted job finds its own.

``unbroken run`` (the node's agent) creates the directory at launch, names it to the
workers in :data:`ENV` (and :data:`AGENT_ENV`) and removes it when the job ends
(:func:`remove`), so its workers never remove their slots (:func:`agent_removes`); the checkpoint
layer's :mod:`unbroken.ckpt.memtier` keeps the slots in it. Standard library and xxhash
only: the supervisor imports this without torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
import tempfile
from typing import Any

import xxhash

from unbroken.common.fs import PrivateDirError, private_dir

__all__ = [
    "AGENT_ENV",
    "ENV",
    "PrivateDirError",
    "agent_removes",
    "create",
    "fallback",
    "job_dir",
    "remove",
    "user_root",
]

ENV = "UNBROKEN_MEMORY_TIER"
"""Environment variable naming the job's memory-tier directory (set by ``unbroken run``)."""
AGENT_ENV = "UNBROKEN_MEMORY_TIER_AGENT"
"""Set by ``unbroken run`` to the same path as :data:`ENV` when its agent created the
directory and removes it when the job ends (a directory the user named is not)."""
SHM = "/dev/shm"


def agent_removes(path: str) -> bool:
    """Whether the node's agent removes ``path`` when the job ends: then a worker keeps its
    slots however it ends (a loop that catches a failure and exits 1 looks clean to it)."""
    return bool(path) and os.environ.get(ENV) == path == os.environ.get(AGENT_ENV)


def user_root() -> str:
    """``/dev/shm/unbroken-<uid>``: this user's memory-tier directories."""
    return os.path.join(SHM, f"unbroken-{os.geteuid()}")


def job_dir(key: str) -> str:
    """The memory-tier directory of the job named by ``key`` (not created)."""
    return os.path.join(user_root(), xxhash.xxh3_64_hexdigest(key.encode()))


def create(path: str) -> str:
    """Create ``path`` private (and this user's root above it, when it is that layout), or
    accept it as it is when it already is; anything else raises
    :class:`~unbroken.common.fs.PrivateDirError` naming it and the fix."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.basename(parent).startswith("unbroken-"):
        private_dir(parent, purpose="memory-tier directory")
    return private_dir(path, purpose="memory-tier directory")


def fallback(last: str | None = None) -> str:
    """A private directory of an unpredictable name in /dev/shm (``unbroken-<uid>-<random>``,
    0700, made with ``mkdtemp``), for a job whose :func:`user_root` another user took first:
    nobody can take a name before it exists. ``last``: the one an earlier start of the job
    made (a killed agent leaves it, slots and all), taken again while it is still a
    private directory of this user there; anything else there is left alone."""
    prefix = f"unbroken-{os.geteuid()}-"
    if last and os.path.dirname(last) == SHM and os.path.basename(last).startswith(prefix):
        try:
            st = os.lstat(last)
        except OSError:
            pass
        else:
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                with contextlib.suppress(PrivateDirError):
                    return private_dir(last, purpose="memory-tier directory")
    return tempfile.mkdtemp(prefix=prefix, dir=SHM)


def remove(path: str) -> None:
    """Remove the job's directory and everything in it; a path that is not a private
    directory of this user (a symlink planted in its place, another user's) is left alone
    and refused with :class:`~unbroken.common.fs.PrivateDirError`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PrivateDirError(
            f"{path}: not a directory of this user (a symlink or another user's); the memory "
            "tier's directory was replaced: not removed, remove it by hand"
        )

    def gone(_fn: object, _p: str, err: Any) -> None:
        exc = err[1] if isinstance(err, tuple) else err  # onerror's tuple, onexc's exception
        if not (isinstance(exc, OSError) and exc.errno == errno.ENOENT):
            raise exc  # a rank removing its own slots at the same time is fine

    # rmtree never follows a symlink inside; onexc from 3.12 (onerror is deprecated there)
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=gone)
    else:
        shutil.rmtree(path, onerror=gone)
