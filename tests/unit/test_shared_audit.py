"""The state audit's files (``UNBROKEN_STATE_AUDIT``, common/audit.py) on a shared node:
the directory is private and its fixed names are never followed through a symlink, as
every other directory unbroken creates (README, "Security model: a shared node"); a record
damaged on disk is skipped, never a crash of the drill's judge."""

from __future__ import annotations

import json
import os
import stat
from types import SimpleNamespace

import pytest

from unbroken.common.audit import StateAudit, read_audit
from unbroken.common.fs import PrivateDirError


def _audit(root: str) -> StateAudit:
    state = SimpleNamespace(state_dict=lambda: {"components": {"x": 1}})
    return StateAudit(root, state, SimpleNamespace(rank=0, world=1))


def test_records_are_private_and_follow_no_planted_link(tmp_path):
    """``rank-0.jsonl`` planted as a symlink: the record was appended to whatever it named
    (any file of the job's user), created 0644 in a directory made with the umask."""
    root = tmp_path / "audit"
    _audit(str(root)).saved(1, {"components": {"x": 1}}, None)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "rank-0.jsonl").st_mode) == 0o600
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    os.unlink(root / "rank-0.jsonl")
    os.symlink(target, root / "rank-0.jsonl")
    with pytest.raises(OSError):
        _audit(str(root)).saved(2, {"components": {"x": 2}}, None)
    assert target.read_text() == "keep me\n"


def test_a_directory_others_can_write_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(PrivateDirError, match="state audit"):
        _audit(str(root)).saved(1, {"components": {"x": 1}}, None)
    assert not (root / "rank-0.jsonl").exists()


@pytest.mark.parametrize("rank", [None, "zero", 1.5, [0]])
def test_a_record_without_a_whole_rank_is_skipped(tmp_path, rank):
    """``int(recs[0]["rank"])`` raised KeyError/ValueError/TypeError out of the drill."""
    root = tmp_path / "audit"
    _audit(str(root)).saved(1, {"components": {"x": 1}}, None)
    bad = {"event": "saved", "step": 2, "leaves": {}}
    if rank is not None:
        bad["rank"] = rank
    with open(root / "rank-1.jsonl", "w") as f:
        f.write(json.dumps(bad) + "\n")
    got = read_audit(str(root))
    assert list(got) == [0] and got[0][0]["step"] == 1
