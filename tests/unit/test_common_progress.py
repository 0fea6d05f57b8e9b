"""The one progress-bar factory: draws on a terminal (a real pty), silent elsewhere."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import termios

from unbroken.common.progress import progress_bar
from unbroken.data.prepare.pack import index_directory, pack


def _openpty() -> tuple[int, int]:
    master, slave = os.openpty()
    # a fresh pty is 0 columns wide, where tqdm draws nothing: give it a terminal's size
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    return master, slave


def _read_all(fd: int) -> str:
    chunks = []
    os.set_blocking(fd, False)
    while True:
        try:
            b = os.read(fd, 65536)
        except (BlockingIOError, OSError):  # drained (Linux raises EIO once the slave closed)
            break
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_a_bar_with_total_and_eta() -> None:
    master, slave = _openpty()
    with (
        os.fdopen(slave, "w", buffering=1) as tty,
        progress_bar("stage", total=4000, unit="B", file=tty) as bar,
    ):
        bar.update(1000)
        bar.set_postfix_str("1 shard")
        bar.update(3000)
    text = _read_all(master)
    os.close(master)
    assert "stage" in text and "100%" in text and "4.00k/4.00k" in text, text
    assert "<00:00" in text, text  # the ETA field tqdm shows only with a total


def test_counts_are_not_scaled() -> None:
    master, slave = _openpty()
    with (
        os.fdopen(slave, "w", buffering=1) as tty,
        progress_bar("export", total=3, unit="phase", file=tty) as bar,
    ):
        bar.update(3)
    text = _read_all(master)
    os.close(master)
    assert "3/3" in text and "phase" in text, text


def test_off_when_not_a_terminal_or_disabled() -> None:
    buf = io.StringIO()
    with progress_bar("pack", total=10, file=buf) as bar:
        bar.update(10)
    assert buf.getvalue() == ""
    master, slave = _openpty()
    with (
        os.fdopen(slave, "w", buffering=1) as tty,
        progress_bar("pack", total=10, file=tty, enabled=False) as bar,
    ):
        bar.update(10)
    assert _read_all(master) == ""
    os.close(master)


def test_pack_and_index_draw_on_a_terminal_stderr(tmp_path, monkeypatch) -> None:
    master, slave = _openpty()
    tty = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setattr("sys.stderr", tty)
    samples = [{"__key__": f"{i:04d}", "bin": os.urandom(2000)} for i in range(600)]
    out = str(tmp_path / "packed")
    pack(samples, out, shard_size=1 << 20, workers=1, fsync=False)
    index_directory(out, workers=1)
    monkeypatch.undo()
    tty.close()
    text = _read_all(master)
    os.close(master)
    assert "pack" in text and "600 samples" in text, text
    assert "index" in text and "100%" in text, text  # index knows its total
