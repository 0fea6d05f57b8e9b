"""Private directories and fixed names on a shared node (issue 20 item 4, T-SHARED-NODE).

Another user must not be able to plant a file or a symlink where the job opens a fixed name:
the directory is private (owned by us, 0700 when we create it, never group/world-writable),
and a fixed name inside it is opened without following a link, mode 0600.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest

from unbroken.common.fs import PrivateDirError, open_private, private_dir


def test_created_directory_is_0700(tmp_path) -> None:
    d = private_dir(str(tmp_path / "a" / "run"), purpose="run directory")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_existing_own_directory_is_accepted(tmp_path) -> None:
    d = tmp_path / "mine"
    d.mkdir(mode=0o755)
    assert private_dir(str(d)) == str(d)


@pytest.mark.parametrize("mode", [0o775, 0o777, 0o1777])
def test_group_or_world_writable_directory_is_refused(tmp_path, mode: int) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(PrivateDirError, match=r"cache directory .*mode .*chmod go-w"):
        private_dir(str(d), purpose="cache directory")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_directory_of_another_user_is_refused(tmp_path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(PrivateDirError, match="owned by uid 65534"):
        private_dir(str(d), purpose="run directory")


def test_symlink_and_file_in_place_of_the_directory_are_refused(tmp_path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(PrivateDirError, match="is a symlink"):
        private_dir(str(tmp_path / "link"))
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(PrivateDirError, match="not a directory"):
        private_dir(str(tmp_path / "file"))


def test_open_private_creates_0600_and_never_follows_a_link(tmp_path) -> None:
    d = private_dir(str(tmp_path / "d"))
    fd = open_private(os.path.join(d, "beat"), os.O_RDWR | os.O_CREAT)
    os.close(fd)
    assert stat.S_IMODE(os.stat(os.path.join(d, "beat")).st_mode) == 0o600
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, os.path.join(d, "events"))
    with pytest.raises(OSError) as e:
        open_private(os.path.join(d, "events"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    assert e.value.errno == errno.ELOOP
    assert victim.read_bytes() == b"keep"


def test_open_private_refuses_a_fifo(tmp_path) -> None:
    d = private_dir(str(tmp_path / "d"))
    os.mkfifo(os.path.join(d, "x"))
    with pytest.raises(PrivateDirError, match="regular file"):
        open_private(os.path.join(d, "x"), os.O_RDONLY | os.O_NONBLOCK)


def test_a_symlink_planted_at_a_written_name_is_refused_not_followed(tmp_path):
    """T-SHARED-NODE: every file unbroken writes through HashingWriter (atomic publishes,
    DCP data files, staged and cached shards) refuses a symlink at its name instead of
    writing through it to the file it points at."""
    from unbroken.common.fs import HashingWriter

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    planted = tmp_path / "planted"
    planted.symlink_to(victim)
    with pytest.raises(OSError):
        HashingWriter(str(planted))
    assert victim.read_bytes() == b"keep"
