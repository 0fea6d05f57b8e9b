"""A memory-tier publish from a cached plan (issue 25 item 2: the loop's cost at K = 1).

A full publish calls ``TrainState.state_dict()``, walks the result with the codec and
renders its JSON: ~2 ms of Python per step on the demo model (116 tensors), against a
~0.2 ms copy into the slot. A :class:`Plan` is built from one full publish and records,
for each module and optimizer component, every object ``state_dict()`` reads to decide
what it returns (the module tree, each module's parameter, buffer and child dicts, its
hooks and type; the optimizer's groups, its per-parameter state dicts, its hooks and
type), and the live tensor objects themselves. A later publish (:meth:`Plan.render`)
checks, by identity only, that each of those objects is still the one recorded (never
``==`` on a tensor: a one-element tensor compares by value), and that each tensor still
has the recorded type, dtype, shape and layout; only then are the live tensors copied
(the objects themselves: a tensor whose storage was swapped, ``p.data = t``, is read as
it is now) and only the parts that can change between steps rendered afresh (counters,
the optimizer's groups, components of other kinds, the RNG). Anything else that differs
makes :meth:`Plan.render` return None, and the caller publishes in full, which builds a
new plan. A plan is built only when its own walk finds exactly the tensors of the full
publish it is built from, in order and at the same addresses.

Components of other kinds (scheduler, loader, values, ...) are rendered from their own
``state_dict()`` at every publish; a plan is refused when one of them holds a tensor.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.ckpt import codec, schema
from unbroken.ckpt import rng as _rng
from unbroken.ckpt.save import Job
from unbroken.ckpt.state import COUNTERS, TrainState

__all__ = ["Plan", "Rendered"]

_Module = torch.nn.Module
_Optimizer = torch.optim.Optimizer
_MODULE_METHODS = ("state_dict", "_save_to_state_dict", "get_extra_state")
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (type(None), bool, int, float, str)
_is = operator.is_
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
_layout = operator.attrgetter("layout")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _same(a: list[Any], b: list[Any]) -> bool:
    """The same objects, in the same order (identity: ``==`` on tensors compares values)."""
    return len(a) == len(b) and all(map(_is, a, b))


def _plain_module_type(t: type) -> bool:
    return all(getattr(t, n, None) is getattr(_Module, n) for n in _MODULE_METHODS)


class _ModulePlan:
    """What ``Module.state_dict()`` of ``root`` reads (its pre-order walk of the tree)."""

    def __init__(self, root: _Module) -> None:
        self.root = root
        self.mods: list[_Module] = []
        self._walk(root)
        self.watch = self._watched()
        self.types = list(map(type, self.mods))
        self.kinds = list(set(self.types))
        self.srcs = [
            t
            for m in self.mods
            for t in (
                *(p for p in m._parameters.values() if p is not None),
                *(
                    b
                    for n, b in m._buffers.items()
                    if b is not None and n not in m._non_persistent_buffers_set
                ),
            )
        ]

    def _walk(self, m: _Module) -> None:
        self.mods.append(m)
        for c in m._modules.values():
            if c is not None:
                self._walk(c)

    def _watched(self) -> tuple[list[Any], list[Any], list[Any]]:
        """(objects, keys, dict sizes) of every module's children, parameters and buffers,
        then its non-persistent buffer names."""
        dicts = [d for m in self.mods for d in (m._modules, m._parameters, m._buffers)]
        objs = [v for d in dicts for v in d.values()]
        keys = [k for d in dicts for k in d]
        sizes = [*map(len, dicts), *(frozenset(m._non_persistent_buffers_set) for m in self.mods)]
        return objs, keys, sizes

    def plannable(self) -> bool:
        return all(map(_plain_module_type, self.kinds)) and self.unchanged()

    def unchanged(self) -> bool:
        mods = self.mods
        if not _same(list(map(type, mods)), self.types):
            return False
        if not all(map(_plain_module_type, self.kinds)):
            return False  # a method patched on the class since
        if any(m._state_dict_hooks or m._state_dict_pre_hooks for m in mods):
            return False
        if any(n in vars(m) for m in mods for n in _MODULE_METHODS):
            return False  # a method set on the instance
        objs, keys, sizes = self._watched()
        return _same(objs, self.watch[0]) and keys == self.watch[1] and sizes == self.watch[2]


class _OptimizerPlan:
    """What ``Optimizer.state_dict()`` reads: the groups' parameters, the per-parameter
    state dicts (tensors or immutable scalars), the hooks. The groups' other entries (the
    learning rate...) are rendered at every publish."""

    def __init__(self, opt: _Optimizer, tree: Any) -> None:
        self.opt = opt
        self.watch = self._watched()
        self.srcs = [
            v for d in opt.state.values() for v in d.values() if isinstance(v, torch.Tensor)
        ]
        sd_groups = tree.get("param_groups") if isinstance(tree, dict) else None
        self.params = [list(g.get("params", ())) for g in sd_groups or []]
        self.state_json = _dumps(tree["state"]) if isinstance(tree, dict) else b""

    def _watched(self) -> tuple[list[Any], list[Any], list[Any]]:
        opt = self.opt
        inner = list(opt.state.values())
        groups = [g["params"] for g in opt.param_groups]
        objs = [
            *(p for g in groups for p in g),
            *opt.state,
            *(v for d in inner for v in d.values()),
        ]
        keys = [k for d in inner for k in d]
        sizes = [*map(len, groups), len(opt.state), *map(len, inner)]
        return objs, keys, sizes

    def plannable(self, tree: Any) -> bool:
        opt = self.opt
        values = [v for d in opt.state.values() for v in d.values()]
        return (
            isinstance(tree, dict)
            and list(tree) == ["state", "param_groups"]
            and len(self.params) == len(opt.param_groups)
            and all(type(v) in _TENSOR_TYPES or type(v) in _SCALARS for v in values)
            and all(type(k) in _TENSOR_TYPES or type(k) in _SCALARS for k in opt.state)
            and self.unchanged()
        )

    def unchanged(self) -> bool:
        opt = self.opt
        if type(opt).state_dict is not _Optimizer.state_dict or "state_dict" in vars(opt):
            return False
        if opt._optimizer_state_dict_pre_hooks or opt._optimizer_state_dict_post_hooks:
            return False
        objs, keys, sizes = self._watched()
        return _same(objs, self.watch[0]) and keys == self.watch[1] and sizes == self.watch[2]

    def render(self, path: tuple[str, ...]) -> bytes | None:
        """The component's JSON, the groups rendered now; None if a group holds a tensor."""
        groups = []
        for g, params in zip(self.opt.param_groups, self.params, strict=True):
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = params
            groups.append(packed)
        probe: dict[str, torch.Tensor] = {}
        tree = codec.encode(groups, probe, (*path, "param_groups"))
        if probe:
            return None
        return b'{"state": ' + self.state_json + b', "param_groups": ' + _dumps(tree) + b"}"


@dataclass(frozen=True)
class Rendered:
    """One publish rendered from a plan: the state's JSON, the encoded RNG, the layouts."""

    state_json: bytes
    rng: Any
    layouts: dict[str, Any]


class Plan:
    """See the module docstring. ``sig`` is the slot's key table (key, dtype, shape), ``srcs``
    the live tensors to copy (those with elements, in key order)."""

    def __init__(self, state: TrainState, job: Job) -> None:
        self.state = state
        self.names = list(state.components)
        self.objs = list(state.components.values())
        self.parts: list[tuple[str, Any]] = []  # (name, _ModulePlan | _OptimizerPlan | None)
        comps = job.tree["components"]
        for name, obj in state.components.items():
            if isinstance(obj, _Module):
                self.parts.append((name, _ModulePlan(obj)))
            elif isinstance(obj, _Optimizer):
                self.parts.append((name, _OptimizerPlan(obj, comps.get(name))))
            else:
                self.parts.append((name, None))
        self.json = {n: _dumps(comps[n]) for n, p in self.parts if isinstance(p, _ModulePlan)}
        self.sig = tuple((k, t.dtype, t.shape) for k, t in job.tensors.items())
        srcs = [t for _, p in self.parts if p is not None for t in p.srcs]
        self.all_srcs = srcs
        self.srcs = [t for t in srcs if t.numel()]
        self.types = list(map(type, srcs))
        self.dtypes = [dt for _, dt, _ in self.sig]
        self.shapes = [s for _, _, s in self.sig]
        self.layouts = list(map(_layout, srcs))
        self.generic = [
            (n, o) for (n, p), o in zip(self.parts, self.objs, strict=True) if p is None
        ]
        self.static_layouts = schema.describe(
            {n: o for (n, p), o in zip(self.parts, self.objs, strict=True) if p is not None},
            {n: job.sd["components"][n] for n, p in self.parts if p is not None},
        )

    @classmethod
    def build(cls, state: TrainState, job: Job) -> Plan | None:
        """A plan for ``state`` from the full publish ``job`` just made of it, or None when
        the state is not one a plan can follow (see the module docstring)."""
        if type(state).state_dict is not TrainState.state_dict:
            return None
        try:
            plan = cls(state, job)
        except (KeyError, TypeError, AttributeError, ValueError):
            return None
        return plan if plan._matches(job) else None

    def _matches(self, job: Job) -> bool:
        """The plan's own walk finds the full publish's tensors, in order, at the same
        addresses, and every component it follows is one it can follow."""
        comps = job.tree["components"]
        for name, p in self.parts:
            if isinstance(p, _ModulePlan) and not p.plannable():
                return False
            if isinstance(p, _OptimizerPlan) and not p.plannable(comps.get(name)):
                return False
            if p is None and codec.tensor_keys(comps.get(name)):
                return False  # a component of another kind holding a tensor
        want = list(job.tensors.values())
        return (
            len(want) == len(self.all_srcs)
            and all(type(t) in _TENSOR_TYPES for t in self.all_srcs)
            and all(t.layout is torch.strided for t in self.all_srcs)
            and all(
                a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                for a, b in zip(self.all_srcs, want, strict=True)
            )
        )

    def render(self) -> Rendered | None:
        """This step's publish from the plan, or None when anything the plan follows
        changed (the caller then publishes in full)."""
        st = self.state
        if not (
            list(st.components) == self.names and _same(list(st.components.values()), self.objs)
        ):
            return None
        srcs = self.all_srcs
        if not (
            _same(list(map(type, srcs)), self.types)
            and list(map(_dtype, srcs)) == self.dtypes
            and list(map(_shape, srcs)) == self.shapes
            and _same(list(map(_layout, srcs)), self.layouts)
        ):
            return None
        counters = _dumps({k: int(getattr(st, k)) for k in COUNTERS})
        parts: list[bytes] = []
        layouts = dict(self.static_layouts)
        for name, p in self.parts:
            path = ("components", name)
            if isinstance(p, _ModulePlan):
                if not p.unchanged():
                    return None
                raw = self.json[name]
            elif isinstance(p, _OptimizerPlan):
                got = p.render(path) if p.unchanged() else None
                if got is None:
                    return None
                raw = got
            else:
                obj = st.components[name]
                sd = obj.state_dict()
                probe: dict[str, torch.Tensor] = {}
                raw = _dumps(codec.encode(sd, probe, path))
                if probe:
                    return None
                layouts.update(schema.describe({name: obj}, {name: sd}))
            parts.append(_dumps(name) + b": " + raw)
        state_json = b'{"counters": ' + counters + b', "components": {' + b", ".join(parts) + b"}}"
        rng = codec.encode(_rng.capture(st.numpy_generators), None) if st.capture_rng else None
        return Rendered(state_json, rng, {n: layouts[n] for n in self.names})
