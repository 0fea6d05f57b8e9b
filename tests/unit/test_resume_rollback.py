"""Rolling back (``restore(step)`` of an older step, then training on) starts a trajectory
of its own: its saves must happen, and a crash must resume it, not the abandoned one.

Before: every ``maybe_save`` at a step the abandoned trajectory had saved was skipped
silently ("already exists"), so after ``restore(10)`` with steps 20 and 30 on disk nothing
was saved for 20+ steps, and a crash resumed the *old* step 30 (the learning rate the user
lowered after a loss spike came back). Now the first save after such a restore moves the
newer steps aside (``corrupt-step-N-superseded``, never deleted), with one WARNING; a
restore(step) that never saves (an evaluation) leaves them in place.
"""

from __future__ import annotations

import logging
import os

import torch

from unbroken.ckpt import Checkpointer, TrainState


def _build() -> tuple[TrainState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainState(model=model, optimizer=opt), model, opt


def _train_to(st: TrainState, model: torch.nn.Module, opt: torch.optim.Optimizer, upto: int,
              ck: Checkpointer | None = None) -> list[int]:  # fmt: skip
    saved = []
    while st.step < upto:
        model(torch.ones(3, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        st.step += 1
        if ck is not None and ck.maybe_save():
            saved.append(st.step)
    return saved


def test_training_on_after_a_rollback_saves_and_resumes_its_own_steps(tmp_path, caplog) -> None:
    root = str(tmp_path)
    st, model, opt = _build()
    ck = Checkpointer(root, st, every_steps=10, keep_last=3, quiet=True)
    assert _train_to(st, model, opt, 30, ck) == [10, 20, 30]
    ck.close()

    st, model, opt = _build()
    ck = Checkpointer(root, st, every_steps=10, keep_last=3, quiet=True)
    assert ck.restore(10) == 10
    opt.param_groups[0]["lr"] = 0.001  # the reason to roll back
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        assert _train_to(st, model, opt, 35, ck) == [20, 30]
    ck.close()
    warned = " | ".join(r.getMessage() for r in caplog.records)
    assert "20" in warned and "30" in warned and "superseded" in warned, warned
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert {"corrupt-step-00000020-superseded", "corrupt-step-00000030-superseded"} <= set(
        os.listdir(root)
    )  # moved aside, not deleted

    st2, model2, opt2 = _build()  # a crash at 35: the restart resumes this trajectory
    ck2 = Checkpointer(root, st2, quiet=True)
    assert ck2.restore() == 30
    ck2.close()
    assert opt2.param_groups[0]["lr"] == 0.001
    _train_to(st2, model2, opt2, 35)
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())


def test_an_evaluation_of_an_older_step_moves_nothing(tmp_path) -> None:
    root = str(tmp_path)
    st, model, opt = _build()
    ck = Checkpointer(root, st, every_steps=10, quiet=True)
    _train_to(st, model, opt, 30, ck)
    ck.close()
    st, _, _ = _build()
    ck = Checkpointer(root, st, quiet=True)
    assert ck.restore(10) == 10
    ck.close()
    assert [c.step for c in ck.list()] == [10, 20, 30]
