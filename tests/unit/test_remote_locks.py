"""The node cache's unit locks: a reader waiting for a download is woken by its end."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from typing import Any

from unbroken.data.stream.remote.locks import UnitLocks


def test_a_nap_ends_when_the_download_it_waits_for_releases_its_lock(tmp_path: Any) -> None:
    """issue 22 round 3 item 2 (measured there: a reader woke 1-2 ms on average after the
    download it waited for ended): a reader napping on a unit whose lock a download holds
    returns as soon as the lock is released, not when its nap runs out (5 s here)."""
    os.makedirs(tmp_path / ".locks", mode=0o700)
    locks = UnitLocks(str(tmp_path))
    holder = os.open(locks.path("d", 3), os.O_RDWR | os.O_CREAT, 0o600)  # the downloader
    fcntl.flock(holder, fcntl.LOCK_EX)
    done = threading.Event()
    ended: list[float] = []

    def reader() -> None:
        locks.nap("d", 3, 5.0)
        ended.append(time.monotonic())
        done.set()

    t = threading.Thread(target=reader)
    t.start()
    deadline = time.monotonic() + 10
    while not any(x.name == "unbroken-cache-wake" for x in threading.enumerate()):
        assert time.monotonic() < deadline, "the reader never started waiting on the lock"
        time.sleep(0.001)
    released = time.monotonic()
    fcntl.flock(holder, fcntl.LOCK_UN)
    os.close(holder)
    assert done.wait(4.0), "the nap ran out instead of ending at the release"
    t.join()
    woke = ended[0] - released
    assert 0 <= woke < 1.0, woke  # (a loaded box: milliseconds when quiet)
