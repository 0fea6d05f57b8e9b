"""The memory tier's directory and its lifetime (issue 25 item 1; T-SHARED-NODE): created
private, removed without following a symlink planted in its place, per job and per user."""

from __future__ import annotations

import os
import stat

import pytest

from unbroken.common import memdir
from unbroken.common.fs import PrivateDirError


def test_job_dirs_are_per_user_and_per_job() -> None:
    """issue 25 item 1: two jobs of one user never share a directory; a job finds its own."""
    a, b = memdir.job_dir("run a"), memdir.job_dir("run b")
    assert a != b and a == memdir.job_dir("run a")
    assert os.path.dirname(a) == memdir.user_root() == f"/dev/shm/unbroken-{os.geteuid()}"


def test_create_is_private_and_remove_takes_everything(tmp_path) -> None:
    """issue 25 item 1: the agent's directory is 0700 and goes with all its slots."""
    path = memdir.create(str(tmp_path / "unbroken-x" / "job"))
    for p in (path, os.path.dirname(path)):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700
    os.makedirs(os.path.join(path, "rank-0"), mode=0o700)
    with open(os.path.join(path, "rank-0", "slot-0"), "wb") as f:
        f.write(b"x")
    memdir.remove(path)
    assert not os.path.lexists(path)
    memdir.remove(path)  # already gone: fine


def test_planted_symlink_is_neither_used_nor_followed_by_remove(tmp_path) -> None:
    """issue 25 item 1 (attack): another process plants a symlink where the job's
    directory goes; create refuses it, and remove neither follows it nor deletes it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    link = tmp_path / "job"
    os.symlink(victim, link)
    with pytest.raises(PrivateDirError, match="symlink"):
        memdir.create(str(link))
    with pytest.raises(PrivateDirError, match="not a directory of this user"):
        memdir.remove(str(link))
    assert (victim / "keep").read_text() == "precious" and os.path.islink(link)
    # a symlink inside the directory is unlinked, its target left alone
    path = memdir.create(str(tmp_path / "job2"))
    os.symlink(victim, os.path.join(path, "rank-0"))
    memdir.remove(path)
    assert (victim / "keep").read_text() == "precious"


def test_group_writable_directory_is_refused(tmp_path) -> None:
    """issue 25 item 1 (attack): a directory others may write in is never used."""
    path = tmp_path / "job"
    path.mkdir(mode=0o700)
    os.chmod(path, 0o770)
    with pytest.raises(PrivateDirError, match="mode 0770"):
        memdir.create(str(path))
