"""``/dev/shm/unbroken-<uid>`` is a name any user of the node can take first (/dev/shm is
world-writable): another user who made it stopped every memory-tier job of ours (each
worker refused it, twice: exit 3). ``unbroken run`` then uses a private directory of an
unpredictable name instead, and the refusal's fix fits a directory of another owner."""

from __future__ import annotations

import os
import stat

import pytest

from unbroken.common import memdir
from unbroken.common.fs import PrivateDirError, private_dir
from unbroken.elastic.supervisor import RunConfig, Supervisor


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A /dev/shm of the test's own (sticky, world-writable like the real one)."""
    d = tmp_path / "shm"
    d.mkdir()
    os.chmod(d, 0o1777)
    monkeypatch.setattr(memdir, "SHM", str(d))
    monkeypatch.delenv(memdir.ENV, raising=False)
    monkeypatch.delenv(memdir.AGENT_ENV, raising=False)
    return d


def test_a_taken_user_root_gives_the_run_a_private_directory_elsewhere(tmp_path, shm):
    taken = shm / f"unbroken-{os.geteuid()}"
    taken.mkdir()
    os.chmod(taken, 0o777)  # as another user's would be: not private to us
    sup = Supervisor(RunConfig(("train.py",), run_dir=str(tmp_path / "run")))
    path = sup._own_memory_tier()
    try:
        assert path is not None and os.path.dirname(path) == str(shm)
        assert not path.startswith(str(taken) + os.sep)
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert os.environ[memdir.ENV] == os.environ[memdir.AGENT_ENV] == path
        assert memdir.create(path) == path  # what a worker's memory tier does with it
    finally:
        sup._drop_memory_tier(None)
    assert not os.path.exists(path) and memdir.ENV not in os.environ


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_the_fix_for_another_users_directory_is_not_chmod(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    os.chown(d, 65534, 65534)
    with pytest.raises(PrivateDirError) as e:
        private_dir(str(d), purpose="memory-tier directory")
    assert "owned by uid 65534" in str(e.value) and "chmod" not in str(e.value)
    assert "remove" in str(e.value) and "another path" in str(e.value)


def test_the_next_start_of_the_run_reuses_the_directory_a_killed_one_left(tmp_path, shm):
    """A SIGKILLed supervisor leaves its memory tier (its restart restores from the slots);
    with a name of chance the next start made another one, and the old one, slots and all,
    stayed in /dev/shm (RAM) for good. The run's ``start`` event names it: the next start
    of the same run directory takes it again while it is still a private directory of ours."""
    taken = shm / f"unbroken-{os.geteuid()}"
    taken.mkdir()
    os.chmod(taken, 0o777)
    run = str(tmp_path / "run")
    first = Supervisor(RunConfig(("train.py",), run_dir=run))
    private_dir(run)
    path = first._own_memory_tier()
    assert path is not None
    first._event("start", memory_tier=path)  # what run() records; then it is SIGKILLed
    for var in (memdir.ENV, memdir.AGENT_ENV):  # the next supervisor is a new process
        del os.environ[var]
    (shm / os.path.basename(path) / "slot").write_bytes(b"x")
    again = Supervisor(RunConfig(("train.py",), run_dir=run))
    try:
        assert again._own_memory_tier() == path
    finally:
        again._drop_memory_tier(None)
    assert not os.path.exists(path)
    # gone, or planted as a symlink: a new one, the planted name untouched
    os.symlink(str(tmp_path), path)
    third = Supervisor(RunConfig(("train.py",), run_dir=run))
    try:
        got = third._own_memory_tier()
        assert got not in (None, path) and os.path.islink(path)
    finally:
        third._drop_memory_tier(None)
