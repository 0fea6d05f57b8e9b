"""C-ASYNC: background saves block only for the snapshot, never tear, report failures."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from unbroken.ckpt import Checkpointer, TrainState, read_checkpoint
from unbroken.common import fs as _fs


def _setup(seed: int = 0) -> tuple[TrainState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return TrainState(model=m, optimizer=opt), m, opt


def _step(st: TrainState, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    st.step += 1


def test_async_checkpoint_equals_sync_checkpoint(tmp_path) -> None:
    st, m, opt = _setup()
    for _ in range(3):
        _step(st, m, opt)
    Checkpointer(str(tmp_path / "sync"), st).save()
    ck = Checkpointer(str(tmp_path / "async"), st, async_save=True)
    ck.save()
    ck.close()
    a, b = read_checkpoint(str(tmp_path / "sync")), read_checkpoint(str(tmp_path / "async"))
    for part in ("model", "optimizer"):
        sa, sb = a["components"][part], b["components"][part]
        if part == "optimizer":
            sa, sb = sa["state"], sb["state"]
            sa = {f"{i}/{k}": v for i, d in sa.items() for k, v in d.items()}
            sb = {f"{i}/{k}": v for i, d in sb.items() for k, v in d.items()}
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_snapshot_never_tears_under_immediate_mutation(tmp_path) -> None:
    st, m, opt = _setup()
    _step(st, m, opt)
    ck = Checkpointer(str(tmp_path), st, async_save=True, keep_last=None)
    for _ in range(3):  # repeatedly: buffers are reused from the second save on
        expected = {k: v.clone() for k, v in m.state_dict().items()}
        expected_m = opt.state_dict()["state"][0]["exp_avg"].clone()
        ck.save()
        with torch.no_grad():  # mutate in place the moment save() returns
            for p in m.parameters():
                p.add_(1000.0)
        _step(st, m, opt)  # and an optimizer step, which rewrites the moments in place
        step = ck.wait()
        assert step is not None
        got = read_checkpoint(str(tmp_path), st.step - 1)
        for k, v in expected.items():
            assert torch.equal(got["components"]["model"][k], v), k
        assert torch.equal(got["components"]["optimizer"]["state"][0]["exp_avg"], expected_m)
    assert ck.last_blocked_seconds is not None
    ck.close()


def test_background_failure_is_reported_and_previous_stays_valid(tmp_path, monkeypatch) -> None:
    st, m, opt = _setup()
    ck = Checkpointer(str(tmp_path), st, async_save=True)
    ck.save()
    ck.wait()
    _step(st, m, opt)

    def broken(self, b):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_fs.HashingWriter, "write", broken)
    ck.save()  # returns: the failure happens in the background
    _step(st, m, opt)
    with pytest.raises(OSError, match="Input/output error"):
        ck.save()  # the next call waits for the previous one and reports its failure
    monkeypatch.undo()
    # no debris, no partial step (.lock: ck is still this root's writer)
    assert sorted(os.listdir(tmp_path)) == [".lock", "step-00000000"]
    st2, m2, _ = _setup(seed=1)
    assert Checkpointer(str(tmp_path), st2).restore() == 0
    ck.close()


def test_buffers_are_allocated_ahead_so_the_first_save_only_copies(tmp_path) -> None:
    st, m, opt = _setup()
    ck = Checkpointer(str(tmp_path / "ck"), st, async_save=True, every_steps=3)
    _step(st, m, opt)
    assert not ck.maybe_save()  # step 1: not due, the checkpoint thread allocates
    assert ck._prepared is not None
    ck._prepared.result()
    buffers = dict(ck._snap._buffers)
    state_bytes = sum(p.numel() * 4 for p in m.parameters()) * 3  # weights + 2 Adam moments
    assert ck._snap.allocated_bytes >= state_bytes
    _step(st, m, opt)
    ck.maybe_save()
    _step(st, m, opt)
    assert ck.maybe_save()  # step 3: the first save uses the prepared buffers...
    assert all(ck._snap._buffers[k] is b for k, b in buffers.items())
    ck.close()
    saved = read_checkpoint(str(tmp_path / "ck"))["components"]["model"]
    for k, v in m.state_dict().items():  # ...and holds this step's values, not zeros
        assert torch.equal(saved[k], v)


def test_a_restore_allocates_the_buffers_ahead_of_the_first_save(tmp_path) -> None:
    """A resumed job that calls ``save()`` itself (no ``maybe_save`` to prepare at a step
    boundary) must not pay the buffers' allocation in its first save's stall either: the
    restored state is complete, so the checkpoint thread allocates them right after it."""
    st, m, opt = _setup()
    _step(st, m, opt)
    Checkpointer(str(tmp_path / "ck"), st).save()
    st2, m2, opt2 = _setup(seed=1)
    ck = Checkpointer(str(tmp_path / "ck"), st2, async_save=True)
    assert ck._prepared is None
    assert ck.restore() == 1 and ck._prepared is not None
    ck._prepared.result()
    buffers = dict(ck._snap._buffers)
    assert ck._snap.allocated_bytes >= sum(p.numel() * 4 for p in m2.parameters()) * 3
    _step(st2, m2, opt2)
    ck.save()
    assert all(ck._snap._buffers[k] is b for k, b in buffers.items())
    ck.close()
    saved = read_checkpoint(str(tmp_path / "ck"))["components"]["model"]
    assert all(torch.equal(saved[k], v) for k, v in m2.state_dict().items())
