"""How long readers wait for the network: per rank process, ``<cache_dir>/.stats/<pid>``
holds one slot per DataLoader worker of int64 (nanoseconds blocked on downloads so far, start
of the block in progress or 0). Readers write their slot (:class:`WaitSlot`);
:class:`unbroken.data.diagnose.timer.StepTimer` reads them around every ``next()``
(:class:`NetworkWaitProbe`) to split a step's wait into network and the rest."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import Any

import numpy as np

from unbroken.common.fs import open_private, private_dir

__all__ = ["NetworkWaitProbe", "WaitSlot", "network_probe", "sweep_stats"]

SLOTS = 64  # network-wait slots per rank process (one per DataLoader worker)
SLOT_FILE_BYTES = SLOTS * 16


def _stats_path(cache_dir: str, pid: int) -> str:
    return os.path.join(cache_dir, ".stats", str(pid))


def _map_stats(path: str) -> tuple[mmap.mmap, np.ndarray]:
    private_dir(os.path.dirname(path), purpose="cache directory")
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        if os.fstat(fd).st_size < SLOT_FILE_BYTES:
            os.ftruncate(fd, SLOT_FILE_BYTES)
        mm = mmap.mmap(fd, SLOT_FILE_BYTES)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.int64).reshape(SLOTS, 2)


class NetworkWaitProbe:
    """Read side of the network-wait counters of one rank process (default: this one).

    Each reading process of the rank (the process itself with ``num_workers=0``, else each
    DataLoader worker, whose parent is the rank process) keeps in ``.stats/<pid>`` the total
    nanoseconds it spent blocked on a download and when its current block began.
    """

    def __init__(self, cache_dir: str, pid: int | None = None) -> None:
        self.path = _stats_path(cache_dir, os.getpid() if pid is None else pid)
        self._mm, self._slots = _map_stats(self.path)

    def blocked_ns(self) -> np.ndarray:
        """Per reading process: nanoseconds blocked on downloads so far (a block in progress
        counted up to now)."""
        s = self._slots.copy()
        now = time.monotonic_ns()
        since = s[:, 1]
        return s[:, 0] + np.where(since > 0, np.maximum(now - since, 0), 0)

    def close(self) -> None:
        self._mm.close()


def network_probe(dataset: Any) -> NetworkWaitProbe | None:
    """The probe for a ``StreamingDataset`` reading a remote source; None for local data."""
    cache = getattr(dataset, "cache", None)
    return None if cache is None else NetworkWaitProbe(cache.cache_dir)


class WaitSlot:
    """The write side, in one reading process: its slot of its rank's file, mapped on first
    use (per process: a forked worker maps its own)."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self._pid = -1
        self._mm: mmap.mmap | None = None
        self._slot: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"cache_dir": self.cache_dir, "_pid": -1, "_mm": None, "_slot": None}

    def _here(self) -> np.ndarray:
        if self._slot is None or self._pid != os.getpid():
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            owner = os.getppid() if info is not None else os.getpid()
            self._mm, slots = _map_stats(_stats_path(self.cache_dir, owner))
            self._slot = slots[(info.id if info is not None else 0) % SLOTS]
            self._pid = os.getpid()
        return self._slot

    def block(self, on: bool) -> None:
        """A wait for a download begins (``on``) or ends."""
        slot = self._here()
        now = time.monotonic_ns()
        if on:
            slot[1] = now
        else:
            since = int(slot[1])
            if since > 0:
                slot[0] += now - since
            slot[1] = 0


def sweep_stats(cache_dir: str) -> None:
    """Remove the slot files of rank processes that are gone."""
    sdir = os.path.join(cache_dir, ".stats")
    for name in os.listdir(sdir):
        if not (name.isascii() and name.isdigit()):
            continue
        try:
            if int(name) <= 0:  # os.kill(0, 0) would ask about this process group
                raise ProcessLookupError
            os.kill(int(name), 0)
        except (ProcessLookupError, OverflowError):  # gone, or a name no pid can be
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(sdir, name))
        except PermissionError:
            pass
