"""The memory tier's publish from a cached plan (issue 25 item 2: the loop's cost at K = 1;
``ckpt/memplan.py``).

A plan skips ``state_dict()`` and the codec walk; it must never publish a tensor stale: a
parameter replaced, resized or re-typed, an optimizer state resized or replaced (even by a
one-element tensor of equal value), a param group added, a buffer or a state-dict hook
registered between two publishes, and the slot still holds the live state bit-exactly and
restores it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckptkit import identical, small_state, snapshot, train
from unbroken.ckpt import Checkpointer, TrainState, codec, schema
from unbroken.ckpt.memtier import MemoryTier
from unbroken.ckpt.save import encode


def _ckpt(root: str, tier: str, st: TrainState) -> Checkpointer:
    return Checkpointer(root, st, every_steps=1000, memory_every_steps=1, memory_dir=tier)


def _memory(ck: Checkpointer) -> MemoryTier:
    assert ck._memory is not None
    return ck._memory


def _slot_state(ck: Checkpointer, step: int) -> dict[str, Any]:
    """The newest slot's state, decoded (tensors owned)."""
    snap, bad = _memory(ck).store.newest()
    assert snap is not None and snap.step == step, (snap, bad)
    sd = codec.decode(snap.tree, {k: t.clone() for k, t in snap.tensors.items()})
    sd["rng"] = snap.rng
    del snap
    return sd


def _first(opt: torch.optim.Optimizer) -> torch.Tensor:
    return opt.param_groups[0]["params"][0]


def _hook(m: torch.nn.Module, sd: dict[str, Any], prefix: str, local: Any) -> None:
    sd[prefix + "2.bias"] = sd[prefix + "2.bias"] * 0 + 7


CHANGES: dict[str, Callable[[Any, Any], object]] = {
    "replace-parameter": lambda m, o: setattr(
        m[0], "weight", torch.nn.Parameter(torch.randn_like(m[0].weight))
    ),
    "swap-parameter-storage": lambda m, o: setattr(
        m[0].weight, "data", torch.randn_like(m[0].weight)
    ),
    "resize-parameter": lambda m, o: setattr(m[2].bias, "data", torch.randn(8)),
    "retype-parameter": lambda m, o: setattr(m[2].bias, "data", m[2].bias.data.double()),
    "retype-module": lambda m, o: m.double(),
    "resize-optimizer-state": lambda m, o: o.state[_first(o)].update(
        exp_avg=torch.randn(2 * _first(o).numel())
    ),
    "resize-optimizer-state-in-place": lambda m, o: o.state[_first(o)]["exp_avg_sq"].resize_(3),
    "retype-optimizer-state": lambda m, o: o.state[_first(o)].update(
        exp_avg=o.state[_first(o)]["exp_avg"].double()
    ),
    "replace-step-by-equal-then-move-it": lambda m, o: o.state[_first(o)].update(
        step=o.state[_first(o)]["step"].clone().add_(100)
    ),
    "add-param-group": lambda m, o: o.add_param_group(
        {"params": [torch.nn.Parameter(torch.randn(3))], "lr": 0.5}
    ),
    "register-buffer": lambda m, o: m[0].register_buffer("extra", torch.randn(5)),
    "state-dict-hook": lambda m, o: m.register_state_dict_post_hook(_hook),
    "replace-optimizer-state-dict": lambda m, o: o.state.__setitem__(
        _first(o), {k: v.clone().add_(1) for k, v in o.state[_first(o)].items()}
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_structure_change_between_publishes_is_never_published_stale(
    tmp_path, change: str
) -> None:
    """issue 25 item 2: three steps publish (the first in full, the next from its plan);
    then ``change`` and one more publish: the slot holds the live state bit-exactly, and a
    restore from it (into the same, changed, objects, their values scrambled) is what
    applying the live state itself gives."""
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    st, m, opt = small_state()
    ck = _ckpt(root, tier, st)
    for _ in range(3):
        train(st, m, opt, 1)
        ck.maybe_save()
    assert _memory(ck).planned == 2, "the steps after the first publish from the plan"
    CHANGES[change](m, opt)
    st.step += 1
    ck.maybe_save()
    ck.wait()
    want = snapshot(st)
    assert identical(_slot_state(ck, st.step), want)
    # a crash, then a restore from the slot into the same objects with other values
    _memory(ck).store.close()
    ck._lock.release()
    with torch.no_grad():
        for t in encode(st)[3].values():
            t.add_(1)
    torch.manual_seed(99)
    ck2 = _ckpt(root, tier, st)
    assert ck2.restore() == st.step and ck2.restored_tier == "memory"
    got = snapshot(st)
    st.load_state_dict(want)  # the exact live state applied (an optimizer casts its state)
    assert identical(got, snapshot(st))
    ck2.close()


def test_every_publish_after_the_first_is_planned_and_equals_a_full_one(tmp_path) -> None:
    """issue 25 item 2: a steady loop publishes from the plan at every step after the
    first, and each planned slot is what a full publish writes: the same state JSON, RNG,
    key table and layouts (the scheduler, a component of another kind, rendered afresh)."""
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    st, m, opt = small_state(values={"best": 1.0})
    ck = _ckpt(root, tier, st)
    for i in range(6):
        train(st, m, opt, 1)
        st.values["best"] = 1.0 / (i + 2)
        ck.maybe_save()
        ck.wait()
        sd, rng, tree, live = encode(st)
        snap, _ = _memory(ck).store.newest()
        assert snap is not None and snap.step == st.step
        assert json.dumps(snap.tree) == json.dumps(tree)
        assert json.dumps(codec.encode(snap.rng, None)) == json.dumps(codec.encode(rng, None))
        assert list(snap.tensors) == list(live)
        assert all(identical(snap.tensors[k], t) for k, t in live.items())
        assert snap.meta["layouts"] == schema.describe(st.components, sd["components"])
        del snap
    assert _memory(ck).planned == 5
    ck.close()


def test_a_state_a_plan_cannot_follow_is_published_in_full(tmp_path) -> None:
    """issue 25 item 2: a module with its own extra state (what ``state_dict()`` returns
    for it is not the parameter walk's) gets no plan; every publish is full and exact, and
    a plan is not tried again at every step."""

    class Extra(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return {"calls": 1}

        def set_extra_state(self, state: Any) -> None:
            pass

    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    torch.manual_seed(0)
    m = torch.nn.Sequential(Extra(4, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    st = TrainState(model=m, optimizer=opt)
    ck = _ckpt(root, tier, st)
    for _ in range(4):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        st.step += 1
        ck.maybe_save()
        ck.wait()
        assert identical(_slot_state(ck, st.step), snapshot(st))
    memory = _memory(ck)
    assert memory.planned == 0 and memory._plan is None and memory._replan_at > 1
    ck.close()
