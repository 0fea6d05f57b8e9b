"""A component whose tensors change shape as it runs (a history that grows) resumes
(C-IDENTICAL): a restarted process builds it empty, so its live tensor never has the saved
shape. The fit check refused every checkpoint of it ("[5] in the checkpoint, [0] live"), a
run that could never resume. Only the component's own ``load_state_dict`` can say whether it
takes another shape: a plain ``Stateful`` is given a new tensor, and one that refuses
(``copy_`` into its own) still refuses before anything changes. Modules and optimizers keep
torch's rule: the same shapes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from unbroken.ckpt import Checkpointer, RestoreRefused, TrainState


class _History:
    """Every loss so far, as one tensor (``torch.cat`` per step)."""

    def __init__(self) -> None:
        self.losses = torch.zeros(0)

    def state_dict(self) -> dict[str, Any]:
        return {"losses": self.losses}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.losses = sd["losses"]


class _Fixed(_History):
    """Takes its saved state into its own tensor: another shape is refused."""

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.losses.copy_(sd["losses"])


def _run(seed: int, steps: int, hist: _History) -> tuple[TrainState, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    st = TrainState(model=model, extras={"history": hist})
    for _ in range(steps):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        hist.losses = torch.cat([hist.losses, loss.detach().reshape(1)])
        st.step += 1
    return st, model


def test_a_history_that_grows_resumes_with_its_saved_length(tmp_path) -> None:
    st, model = _run(0, 5, _History())
    Checkpointer(str(tmp_path), st, quiet=True).save()
    saved = st.components["extra.history"].losses.clone()

    live = _History()  # a restarted process: empty
    st2, model2 = _run(1, 0, live)
    ck = Checkpointer(str(tmp_path), st2, quiet=True)
    assert ck.restore() == 5
    ck.close()
    assert torch.equal(live.losses, saved)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )


def test_a_component_that_refuses_another_shape_changes_nothing(tmp_path) -> None:
    st, _ = _run(0, 5, _History())
    Checkpointer(str(tmp_path), st, quiet=True).save()

    live = _Fixed()
    st2, model2 = _run(1, 2, live)
    before = [p.detach().clone() for p in model2.parameters()]
    losses = live.losses.clone()
    with pytest.raises(RestoreRefused, match="history"):
        Checkpointer(str(tmp_path), st2, quiet=True).restore()
    assert torch.equal(live.losses, losses)
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters(), strict=True))


def test_a_module_of_another_shape_is_still_refused(tmp_path) -> None:
    st, _ = _run(0, 1, _History())
    Checkpointer(str(tmp_path), st, quiet=True).save()
    other = TrainState(model=torch.nn.Linear(3, 2), extras={"history": _History()})
    with pytest.raises(RestoreRefused, match=r"components/model/weight: \[1, 3\]"):
        Checkpointer(str(tmp_path), other, quiet=True).restore()
