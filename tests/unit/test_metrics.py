"""MetricLog: rank-aware writing, a fresh start that drops an earlier attempt's lines (and
only a fresh start), damaged lines, and the global order of per-rank sample ids."""

from __future__ import annotations

import os

import pytest

from unbroken.ckpt import Checkpointer, TrainState
from unbroken.metrics import MetricLog, _interleave, read_metrics


def _steps(path: str) -> list[int]:
    return [r["step"] for r in read_metrics(path)]


def test_killed_before_the_first_checkpoint_the_fresh_start_logs_each_step_once(tmp_path):
    path, root = str(tmp_path / "m.jsonl"), str(tmp_path / "ck")
    first = MetricLog(path)  # attempt 1: dies at step 20, before its first checkpoint
    for s in range(1, 21):
        first.log(s, loss=1.0)
    assert _steps(path) == list(range(1, 21))
    ml = MetricLog(path)  # attempt 2: nothing to restore
    state = TrainState(metrics=ml)
    assert Checkpointer(root, state, every_steps=5).restore() is None
    assert _steps(path) == []
    for s in range(1, 8):
        ml.log(s, loss=0.5)
    ml.close()
    assert _steps(path) == list(range(1, 8))


def test_no_truncation_unless_the_run_truly_starts_fresh(tmp_path):
    path, root = str(tmp_path / "m.jsonl"), str(tmp_path / "ck")
    ml = MetricLog(path)
    state = TrainState(metrics=ml)
    ck = Checkpointer(root, state)
    for s in range(1, 6):
        ml.log(s, loss=1.0)
        state.step = s
        if s == 3:
            ck.save()
    ml.close()
    # restored: only the lines past the checkpoint go
    ml2 = MetricLog(path)
    assert Checkpointer(root, TrainState(metrics=ml2)).restore() == 3
    assert _steps(path) == [1, 2, 3]
    ml2.close()
    # a root with files but no valid checkpoint: restore() refuses, the log is untouched
    os.rename(os.path.join(root, "step-00000003"), os.path.join(root, "mine"))
    ml3 = MetricLog(path)
    with pytest.raises(RuntimeError, match="refusing to silently start from scratch"):
        Checkpointer(root, TrainState(metrics=ml3)).restore()
    assert _steps(path) == [1, 2, 3]


def test_only_rank_zero_writes_and_every_rank_keeps_the_step(tmp_path):
    path = str(tmp_path / "sub" / "m.jsonl")
    r0, r1 = MetricLog(path, rank=0), MetricLog(path, rank=1)
    assert r0.writes and not r1.writes
    for s in (1, 2, 3):
        r0.log(s, loss=float(s))
        r1.log(s, loss=-1.0)
    assert r1.state_dict() == r0.state_dict() == {"step": 3}
    assert [r["loss"] for r in read_metrics(path)] == [1.0, 2.0, 3.0]
    r1.load_state_dict({"step": 1})  # rank 1 never rewrites rank 0's file
    r1.start_fresh()
    assert _steps(path) == [1, 2, 3] and r1.step == -1
    r0.load_state_dict({"step": 2})
    assert _steps(path) == [1, 2]
    r0.close()


def test_rank_from_torchrun_environment_and_all_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    quiet = MetricLog(str(tmp_path / "a" / "m.jsonl"))
    assert quiet.rank == 1 and not quiet.writes
    quiet.log(1, loss=0.0)
    assert not (tmp_path / "a").exists()
    own = MetricLog(str(tmp_path / "m-{rank}.jsonl"), all_ranks=True)
    own.log(1, loss=0.0)
    own.close()
    assert _steps(str(tmp_path / "m-1.jsonl")) == [1]
    with pytest.raises(ValueError, match=r"put \{rank\} in the path"):
        MetricLog(str(tmp_path / "m.jsonl"), all_ranks=True)


def test_damaged_lines_are_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1}\n{"st\x00p": 2\n[1, 2]\n{"step": 3}\n{"step": 4')
    assert _steps(str(path)) == [1, 3]  # torn last line: silent; two damaged: one warning
    assert "skipped 2 damaged line(s)" in caplog.text


def test_interleave_gives_the_one_rank_order():
    # rank r of W holds global positions r, r+W, r+2W, ...
    assert _interleave([[0, 2, 4], [1, 3, 5]]) == [0, 1, 2, 3, 4, 5]
    assert _interleave([[0, 2], [1]]) == [0, 1, 2]
    assert _interleave([]) == []
