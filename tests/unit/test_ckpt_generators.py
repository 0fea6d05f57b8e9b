"""Random generators of the loop's own as checkpoint components (C-COMPLETE): a
``torch.Generator``, a ``random.Random`` and an ``np.random.Generator`` handed to
``TrainState(extras=...)`` are saved and restored whole, so a sampler's, a mask's or an
augmentation's stream goes on where it was. A registration of another kind, or a state that
does not fit, is refused by name with the live generators unchanged."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from ckptkit import edit_state, step_dir
from unbroken.ckpt import Checkpointer, RestoreRefused, TrainState


def _gens(seed: int) -> dict[str, Any]:
    return {
        "torch": torch.Generator().manual_seed(seed),
        "python": random.Random(seed),
        "numpy": np.random.default_rng(seed),
    }


def _draw(g: dict[str, Any]) -> list[float]:
    return [
        *torch.rand(3, generator=g["torch"]).tolist(),
        g["python"].random(),
        g["python"].gauss(0.0, 1.0),  # leaves a gauss_next behind: saved too
        float(g["numpy"].random()),
    ]


def test_each_kind_of_generator_goes_on_where_it_was_saved(tmp_path) -> None:
    gens = _gens(3)
    _draw(gens)  # moved on from the seed
    gens["python"].gauss(0.0, 1.0)  # a pending gauss_next at the save
    Checkpointer(str(tmp_path), TrainState(extras=gens)).save(1)
    want = [_draw(gens) for _ in range(3)]
    other = _gens(99)
    assert Checkpointer(str(tmp_path), TrainState(extras=other)).restore() == 1
    assert [_draw(other) for _ in range(3)] == want


def test_a_generator_of_another_kind_is_refused_by_name_and_left_unchanged(tmp_path) -> None:
    Checkpointer(str(tmp_path), TrainState(extras={"g": torch.Generator().manual_seed(1)})).save(1)
    r = random.Random(5)
    before = r.getstate()
    with pytest.raises(RestoreRefused, match=r"'extra.g' was saved from a 'torch' generator"):
        Checkpointer(str(tmp_path), TrainState(extras={"g": r})).restore()
    assert r.getstate() == before


@pytest.mark.parametrize("kind", ["python", "numpy"])
def test_a_crafted_generator_state_is_refused_and_the_live_one_kept(tmp_path, kind) -> None:
    """The state file is untrusted: a python state of the wrong length, a numpy state that
    names another bit generator - each a clear refusal naming the component, nothing
    applied."""
    Checkpointer(str(tmp_path), TrainState(extras={"g": _gens(1)[kind]})).save(1)

    def damage(comp: dict[str, Any]) -> None:
        if kind == "python":
            comp["state"] = comp["state"][:10]
        else:
            comp["state"] = comp["state"].replace("PCG64", "MT19937")

    edit_state(step_dir(str(tmp_path), 1), lambda b: damage(b["state"]["components"]["extra.g"]))
    live = _gens(7)[kind]
    with pytest.raises(RestoreRefused, match=r"component 'extra.g': the saved"):
        Checkpointer(str(tmp_path), TrainState(extras={"g": live})).restore()
    fresh = _gens(7)[kind]  # the live one was not moved: it draws what a fresh one draws
    assert live.random() == fresh.random()
