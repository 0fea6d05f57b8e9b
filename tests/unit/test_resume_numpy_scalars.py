"""A component's numpy scalars come back as the numpy scalars they were (C-IDENTICAL).

``np.float64`` is a subclass of ``float``: saved as a plain float, it came back a python
float, so a resumed loop behaved differently (``best.item()`` raised, ``best / 0`` raised
instead of giving inf) and a final ``save()`` of the step ``maybe_save`` had just saved was
refused as "the live state differs".
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import pytest
import torch

from unbroken.ckpt import Checkpointer, TrainState


class _Stats:
    """A loop's running statistics, kept as numpy scalars (what ``np.mean`` returns)."""

    def __init__(self) -> None:
        self.best = np.float64(np.inf)
        self.count = np.int64(0)
        self.scale = np.float32(1.0)
        self.flag = np.bool_(False)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "count": self.count, "scale": self.scale, "flag": self.flag,
                "history": [self.best, np.float64(0.25)]}  # fmt: skip

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.best, self.count, self.scale, self.flag = sd["best"], sd["count"], sd["scale"], sd["flag"]  # fmt: skip
        self.history = sd["history"]


def _state(seed: int) -> tuple[TrainState, torch.nn.Module, _Stats]:
    torch.manual_seed(seed)
    model, stats = torch.nn.Linear(4, 2), _Stats()
    return TrainState(model=model, extras={"stats": stats}), model, stats


def _train(st: TrainState, model: torch.nn.Module, stats: _Stats, n: int) -> None:
    for _ in range(n):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        stats.best = np.minimum(stats.best, np.float64(loss.item()))
        stats.count += 1
        st.step += 1


def test_numpy_scalars_restore_as_numpy_scalars_and_a_final_save_is_a_no_op(tmp_path) -> None:
    st, model, stats = _state(0)
    ck = Checkpointer(str(tmp_path), st, every_steps=3, quiet=True)
    _train(st, model, stats, 3)
    assert ck.maybe_save()
    ck.save()  # the loop's final save of the step just saved: bit-identical, a no-op
    ck.close()

    st2, _, stats2 = _state(1)
    ck2 = Checkpointer(str(tmp_path), st2, quiet=True)
    assert ck2.restore() == 3
    ck2.close()
    for name in ("best", "count", "scale", "flag"):
        saved, got = getattr(stats, name), getattr(stats2, name)
        assert type(got) is type(saved), (name, type(saved), type(got))
        assert got == saved
    assert [type(v) for v in stats2.history] == [np.float64, np.float64]
    assert stats2.best.item() == stats.best.item()  # a python float has no .item()


class _Phase(enum.IntEnum):
    WARMUP = 0
    MAIN = 1


class _Schedule:
    """A loop's phase as an ``IntEnum`` (an int): stored as the int, rebuilt on load."""

    def __init__(self) -> None:
        self.phase = _Phase.WARMUP
        self.name = _Name("cosine")
        self.tag = np.str_("run-1")  # a str too

    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "name": self.name, "tag": self.tag}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.phase, self.name, self.tag = _Phase(sd["phase"]), _Name(sd["name"]), sd["tag"]


class _Name(str):
    """A str subclass, as an enum of names would be."""


def test_int_and_str_subclasses_in_state_let_the_final_save_be_a_no_op(tmp_path) -> None:
    """An ``IntEnum`` is saved as the int it is (no code from a file can rebuild the
    class); comparing the live state with the step refused the loop's final ``save()`` as
    "the live state differs" (``Phase vs int``). A bool is still not an int."""
    torch.manual_seed(0)
    sched = _Schedule()
    sched.phase = _Phase.MAIN
    st = TrainState(model=torch.nn.Linear(2, 2), extras={"schedule": sched})
    st.step = 4
    ck = Checkpointer(str(tmp_path), st, every_steps=4, quiet=True)
    assert ck.maybe_save()
    ck.save()  # the final save of the step just saved: a no-op
    sched.phase = _Phase.WARMUP  # 0: a real change is still one
    with pytest.raises(FileExistsError, match="phase"):
        ck.save()
    ck.close()


class _Arrays:
    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def state_dict(self) -> dict[str, Any]:
        return {"a": self.a}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.a = sd["a"]


@pytest.mark.parametrize(
    "arr",
    [np.array(["x", 1], dtype=object), np.zeros(2, dtype=[("x", "<f4"), ("y", "<i4")])],
    ids=["object", "structured"],
)
def test_an_array_a_checkpoint_cannot_hold_is_refused_at_save(tmp_path, arr: np.ndarray) -> None:
    """An object array was saved as its pointers (a structured one without its fields), and
    every restore then called the step damaged: a run that saved and could never resume.
    Refused where it is saved, naming the place, and nothing is committed."""
    st = TrainState(model=torch.nn.Linear(2, 2), extras={"arrays": _Arrays(arr)})
    ck = Checkpointer(str(tmp_path), st, quiet=True)
    with pytest.raises(TypeError, match=r"extra\.arrays/a"):
        ck.save(1)
    ck.close()
    assert ck.list() == []
