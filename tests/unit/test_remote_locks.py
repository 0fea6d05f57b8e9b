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


def test_the_fetchers_doorbell_wakes_it_and_is_never_followed(tmp_path: Any) -> None:
    """issue 22 round 4 item 1: the fetcher sleeps on its doorbell until a reader rings it
    (no timed wake), a reader registered at its wake position rings once per position; the
    doorbell is a fresh 0600 FIFO whatever was planted at its fixed name (a symlink is
    removed, never followed), and a ring at a name that is not this user's FIFO writes
    nothing."""
    import stat

    from unbroken.data.stream.remote.readers import (
        Doorbell,
        Registration,
        reader_records,
        ring,
        set_wake,
    )

    for sub in (".readers", ".fetch"):
        os.makedirs(tmp_path / sub, mode=0o700)
    path = str(tmp_path / ".fetch" / "x.wake")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, path)
    ring(path)  # a symlink: not followed
    assert victim.read_bytes() == b"precious"
    bell = Doorbell(path)
    try:
        assert victim.read_bytes() == b"precious"
        st = os.lstat(path)
        assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert not bell.wait(0.01)  # nobody rang
        reg = Registration(str(tmp_path), 7, "k", path)
        reg.register(0, 5)  # a new reader rings
        assert bell.wait(5.0)
        [(name, e, p, want, at)] = reader_records(str(tmp_path), 7, 60.0)
        assert (e, p, want, at) == (0, 5, -1, (-1, -1))
        set_wake(str(tmp_path), name, 0, 40)  # the fetcher: "ring again at position 40"
        reg.register(0, 39)
        assert not bell.wait(0.01)
        reg.register(0, 40)
        reg.register(0, 41)  # once per wake position
        assert bell.wait(5.0) and not bell.wait(0.01)
        reg.touch(want=3)  # waiting for a unit rings
        assert bell.wait(5.0)
    finally:
        bell.close()
    os.unlink(path)
    with open(path, "wb"):
        pass
    ring(path)  # a regular file at the name: nothing written
    assert os.path.getsize(path) == 0


def test_a_registration_a_scan_removed_is_made_again(tmp_path: Any) -> None:
    """issue 22 (an epoch 5-7x slower now and then, seen under load with the fetcher's own
    log): a scan of ``.readers`` removes a record whose lock it can take (a dead reader's).
    A reader between creating its record and locking it looks dead: its record was removed,
    and it went on writing position, heartbeat and the unit it waited for into a file
    nobody saw. The fetcher served only the other worker; this one fetched every unit
    itself after ``grace_s``. The reader's next register() or touch() makes it again."""
    from unbroken.data.stream.remote.readers import Registration, reader_records

    os.makedirs(tmp_path / ".readers", mode=0o700)
    reg = Registration(str(tmp_path), 7, "k", str(tmp_path / "no-bell"))
    reg.register(0, 5)
    [(name, *_)] = reader_records(str(tmp_path), 7, 60.0)
    os.unlink(tmp_path / ".readers" / name)  # what the scan did in that window
    assert reader_records(str(tmp_path), 7, 60.0) == []
    reg.touch(want=9)  # waiting for unit 9: the fetcher must see it
    [(_, e, p, want, _)] = reader_records(str(tmp_path), 7, 60.0)
    assert (e, p, want) == (0, 5, 9)
    os.unlink(tmp_path / ".readers" / name)
    reg.register(0, 6)
    [(_, e, p, want, _)] = reader_records(str(tmp_path), 7, 60.0)
    assert (e, p) == (0, 6)
