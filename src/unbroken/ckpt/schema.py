"""What a rank's state file may hold, checked without the live objects (T-FALL-BACK).

A state file that decodes is not yet one that can be applied: an RNG tensor of another
size, a counter that is text, a PCG64 state where numpy's global MT19937 belongs, an
optimizer whose parameter ids do not match its groups all decode, then make
``load_state_dict`` raise halfway through a restore. :func:`check_state` finds them first,
the same way in ``restore()`` and in ``ckpt verify`` (which has no live objects): the
counters, every RNG stream (set on a scratch generator of its own kind), the tensor
references (exactly this rank's), the components, and the fields of the state layouts the
manifest records (torch optimizers, modules, LR schedulers, ``GradScaler``,
``MetricLog``, the loader, plain ``values``). Anything else a component's own
``load_state_dict`` may refuse is found by restore's rehearsal against the live object
(:mod:`unbroken.ckpt.load`).

The rules per kind of state: ARCHITECTURE.md, "Design notes" > ckpt > what a state file
may hold.
"""

from __future__ import annotations

import logging
import numbers
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from unbroken.ckpt.state import (
    COUNTERS,
    TrainState,
    Values,
    _ShardedModel,
    _ShardedOptimizer,
    check_values,
)

__all__ = ["SchemaError", "check_state", "describe", "generators"]

log = logging.getLogger(__name__)

_INT64 = 1 << 63
_BIT_GENERATORS = ("MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64")


class SchemaError(ValueError):
    """A decoded state that cannot be applied; the message names the field."""


def _is_num(x: Any) -> bool:
    return isinstance(x, numbers.Real | torch.Tensor) and not isinstance(x, bool | np.bool_)


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


Check = Callable[[Any], bool]


def _num(lo: float | None = None, below: float | None = None) -> Check:
    def ok(x: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return True  # e.g. a tensor lr: its bytes are checked as a stored tensor
        return (
            _is_num(x)
            and (lo is None or x >= lo)  # NaN fails both comparisons
            and (below is None or x < below)
        )

    return ok


def _int(lo: int) -> Check:
    return lambda x: _is_int(x) and lo <= x < _INT64


def _one_of(*types: type) -> Check:
    return lambda x: isinstance(x, types)


def _nums(item: Check) -> Check:
    return lambda x: isinstance(x, list | tuple) and all(item(v) for v in x)


_BOOL = _one_of(bool)
_OPT_BOOL = _one_of(bool, type(None))
_STR = _one_of(str)
_NUM = _num()
_NONNEG = _num(lo=0.0)

# Hyperparameters of torch's optimizers, by name (the same name means the same thing in
# every torch optimizer); signs as their constructors require.
_OPTIMIZER_GROUP: dict[str, Check] = {
    **dict.fromkeys(("lr", "weight_decay", "momentum", "lr_decay", "initial_accumulator_value"), _NONNEG),
    # a number, or Adafactor's pair (eps1, eps2) whose eps1 may be None
    "eps": lambda x: _NONNEG(x) or (isinstance(x, list | tuple) and all(v is None or _NONNEG(v) for v in x)),
    **dict.fromkeys(("dampening", "alpha", "rho", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "momentum_decay", "lambd", "t0"), _NUM),
    **dict.fromkeys(("amsgrad", "maximize", "nesterov", "capturable", "differentiable", "centered", "decoupled_weight_decay"), _BOOL),
    **dict.fromkeys(("foreach", "fused"), _OPT_BOOL),
    "betas": lambda x: isinstance(x, list | tuple) and len(x) == 2 and all(_num(0.0, 1.0)(b) for b in x),
}  # fmt: skip
_SCHEDULER: dict[str, Check] = {
    "last_epoch": _int(-1),
    "_step_count": _int(0),
    "base_lrs": _nums(_NUM),
    "_last_lr": _nums(_NUM),
    "min_lrs": _nums(_NUM),
    "max_lrs": _nums(_NUM),
    "step_size": _int(1),
    "_get_lr_called_within_step": _BOOL,
    **dict.fromkeys(("total_iters", "T_0", "T_i", "T_mult", "patience", "cooldown", "cooldown_counter", "num_bad_epochs", "total_steps"), _int(0)),
    **dict.fromkeys(("gamma", "T_max", "T_cur", "eta_min", "start_factor", "end_factor", "factor", "power", "threshold", "eps", "best"), _NUM),
    **dict.fromkeys(("mode", "threshold_mode"), _STR),
}  # fmt: skip
_SCALER: dict[str, Check] = {
    "scale": _num(lo=0.0),
    "growth_factor": _num(lo=0.0),
    "backoff_factor": _num(lo=0.0),
    "growth_interval": _int(1),
    "_growth_tracker": _int(0),
}
_METRICS: dict[str, Check] = {"step": _int(-1)}
_LOADER: dict[str, Check] = {
    "version": _int(0),
    "fingerprint": _STR,
    "seed": _int(-_INT64),
    "epoch": _int(0),
    "samples_consumed": _int(0),
    "shuffle_window": _nums(_int(0)),
}


_LOADERS = (
    "unbroken.data.stream.loader.StatefulLoader",
    "unbroken.data.feed.prefetch.DevicePrefetcher",
)


def _kind(obj: Any) -> str | None:
    """Which schema the manifest records for a live component: only types whose state
    dict layout is torch's (or unbroken's) own, never a subclass that may change it."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    from unbroken.common.metrics import MetricLog

    t = type(obj)
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer) and t.state_dict is torch.optim.Optimizer.state_dict:
        return "optimizer"
    if (
        isinstance(obj, LRScheduler | ReduceLROnPlateau)
        and t.__module__ == "torch.optim.lr_scheduler"
    ):
        return "scheduler"
    if t.__name__ == "GradScaler" and t.__module__.startswith("torch."):
        return "scaler"
    if t is MetricLog:
        return "metrics"
    if t is Values:
        return "values"
    if type_name(obj) in _LOADERS:
        return "loader"
    return None


def _fields(sd: Any, table: Mapping[str, Check], where: str, required: Iterable[str] = ()) -> None:
    if not isinstance(sd, dict):
        raise SchemaError(f"{where} is a {type(sd).__name__}, not a state dict")
    missing = sorted(set(required) - set(sd))
    if missing:
        raise SchemaError(f"{where} lacks {missing}")
    for key, ok in table.items():
        if key in sd and not ok(sd[key]):
            raise SchemaError(f"{where}[{key!r}]={_short(sd[key])} is not what it must be")


def _short(x: Any) -> str:
    if isinstance(x, str | bytes) and len(x) > 80:  # the repr of what is shown, not of all
        x = x[:80]
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _optimizer(sd: Any, where: str, groups: Any) -> None:
    if not (isinstance(sd, dict) and isinstance(sd.get("param_groups"), list)):
        raise SchemaError(f"{where} has no list of param_groups")
    state = sd.get("state", {})
    if not isinstance(state, dict):
        raise SchemaError(f"{where}['state'] is not a dict")
    ids: list[Any] = []
    for i, g in enumerate(sd["param_groups"]):
        if not (isinstance(g, dict) and isinstance(g.get("params"), list)):
            raise SchemaError(f"{where}['param_groups'][{i}] has no list of params")
        _fields(g, _OPTIMIZER_GROUP, f"{where}['param_groups'][{i}]")
        ids += g["params"]
    if all(_is_int(p) for p in ids):
        # torch numbers the parameters 0..N-1 over the groups, in order
        if ids != list(range(len(ids))):
            raise SchemaError(f"{where}: parameter ids {_short(ids)} are not 0..{len(ids) - 1}")
    elif not all(isinstance(p, str) for p in ids) or len(set(ids)) != len(ids):
        raise SchemaError(f"{where}: parameter ids {_short(ids)} are neither 0..N-1 nor names")
    unknown = [k for k in state if k not in set(ids) or isinstance(k, bool)]
    if unknown:
        raise SchemaError(f"{where}: state for parameters {_short(unknown)} in no group")
    if any(not isinstance(s, dict) for s in state.values()):
        raise SchemaError(f"{where}: a parameter's state is not a dict")
    sizes = [len(g["params"]) for g in sd["param_groups"]]
    if isinstance(groups, list) and sizes != groups:
        raise SchemaError(
            f"{where}: parameter groups of sizes {sizes}, the manifest recorded {groups}"
        )


def _module(sd: Any, where: str, extra: Any) -> None:
    """A module's state: tensors, and the non-tensor entries (``get_extra_state``) it had
    when saved (modules load strictly)."""
    if not isinstance(sd, dict):
        raise SchemaError(f"{where} is a {type(sd).__name__}, not a module's state dict")
    mine = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))
    if isinstance(extra, list) and mine != sorted(extra):
        raise SchemaError(
            f"{where}: non-tensor entries {_short(mine)}, the manifest recorded {_short(extra)}"
        )


def _component(name: str, sd: Any, info: Any, where: str) -> None:
    info = info if isinstance(info, Mapping) else {}
    family = info.get("kind")
    here = f"{where}: components[{name!r}]"
    if family == "module":
        _module(sd, here, info.get("extra"))
    elif family == "optimizer":
        _optimizer(sd, here, info.get("param_groups"))
    elif family == "scheduler":
        _fields(sd, _SCHEDULER, here)
    elif family == "scaler":
        _fields(sd, _SCALER, here, required=_SCALER if info.get("enabled") else ())
    elif family == "metrics":
        _fields(sd, _METRICS, here, required=_METRICS)
    elif family == "loader":
        _fields(sd, _LOADER, here)
    elif family == "values":
        try:
            check_values(sd, here)
        except (TypeError, ValueError) as e:
            raise SchemaError(str(e)) from e


def _counters(c: Any, where: str, manifest: Mapping[str, int] | None) -> None:
    if not isinstance(c, dict):
        raise SchemaError(f"{where}: counters is not a dict")
    for k in COUNTERS:
        x = c.get(k)
        if not (type(x) is int and 0 <= x < _INT64):
            raise SchemaError(f"{where}: counters[{k!r}]={_short(x)} is not an integer >= 0")
    if c["micro_step"] != 0:
        raise SchemaError(
            f"{where}: counters['micro_step']={c['micro_step']}; saves happen only at an "
            "optimizer-step boundary (0)"
        )
    if manifest and any(manifest.get(k) != c[k] for k in COUNTERS if k in manifest):
        raise SchemaError(f"{where}: counters {_short(c)} differ from the manifest's")


def _rng(state: Any, where: str, generators: Any) -> None:
    if state is None:
        return
    if not isinstance(state, dict):
        raise SchemaError(f"{where}: rng is not a dict")
    try:
        random.Random().setstate(state["python"])
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"{where}: rng['python'] is not a python random state ({e})") from e
    try:
        np.random.RandomState().set_state(state["numpy"])
    except (KeyError, TypeError, ValueError, OverflowError, IndexError) as e:
        raise SchemaError(f"{where}: rng['numpy'] is not numpy's MT19937 state ({e})") from e
    gens = state.get("numpy_generators", {})
    if not isinstance(gens, dict):
        raise SchemaError(f"{where}: rng['numpy_generators'] is not a dict")
    if isinstance(generators, dict):
        kinds = {
            n: st.get("bit_generator") if isinstance(st, dict) else None for n, st in gens.items()
        }
        if kinds != generators:
            raise SchemaError(
                f"{where}: rng['numpy_generators'] holds {_short(kinds)}, the manifest "
                f"recorded {_short(generators)}"
            )
    for name, st in gens.items():
        kind = st.get("bit_generator") if isinstance(st, dict) else None
        if kind not in _BIT_GENERATORS:
            raise SchemaError(
                f"{where}: rng['numpy_generators'][{name!r}] names bit generator "
                f"{_short(kind)}, not one of {', '.join(_BIT_GENERATORS)}"
            )
        try:
            getattr(np.random, str(kind))().state = st
        except (KeyError, TypeError, ValueError, OverflowError, IndexError) as e:
            raise SchemaError(
                f"{where}: rng['numpy_generators'][{name!r}] is not a {kind} state ({e})"
            ) from e
    t = state.get("torch")
    try:
        torch.Generator().set_state(t)  # type: ignore[arg-type]  # a non-tensor raises
    except (TypeError, RuntimeError, ValueError) as e:
        raise SchemaError(f"{where}: rng['torch'] is not torch's CPU generator state ({e})") from e
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list | tuple) or not all(
        isinstance(x, torch.Tensor)
        and x.dtype == torch.uint8
        and x.dim() == 1
        and x.numel() <= 1024
        for x in cuda
    ):
        raise SchemaError(f"{where}: rng['cuda'] is not a list of CUDA generator states")


def check_state(
    sd: Any,
    rng: Any,
    *,
    refs: Iterable[str],
    stored: Iterable[str],
    components: Mapping[str, Any] | None,
    layouts: Mapping[str, Any] | None,
    generators: Mapping[str, str] | None,
    counters: Mapping[str, int] | None,
    where: str,
) -> None:
    """Raise :class:`SchemaError` unless the decoded state ``sd`` (tensors stand-ins) and
    ``rng`` of one rank can be applied. ``refs``: the stored tensors ``sd`` references;
    ``stored``: those this rank saved (the manifest's); ``components`` and ``layouts``:
    the manifest's records of the components (how each is shared, :mod:`.per_rank`; what
    its state looks like, :func:`describe`; either None in checkpoints written before it);
    ``generators``: the numpy generators registered when it was saved, name -> kind;
    ``counters``: the manifest's (rank 0's), or None for another rank's file."""
    if not (isinstance(sd, dict) and isinstance(sd.get("components"), dict)):
        raise SchemaError(f"{where} holds no component state")
    _counters(sd.get("counters"), where, counters)
    _rng(rng, where, generators)
    refs, stored = set(refs), set(stored)
    if refs != stored:
        extra, missing = sorted(refs - stored)[:3], sorted(stored - refs)[:3]
        raise SchemaError(
            f"{where} references tensors the manifest does not list for it ({extra}) or "
            f"leaves out ones it does ({missing})"
        )
    saved = sd["components"]
    for record in (components, layouts):
        if isinstance(record, Mapping) and set(saved) != set(record):
            raise SchemaError(
                f"{where} holds components {_short(sorted(saved))}, the manifest lists "
                f"{_short(sorted(record))}"
            )
    if isinstance(layouts, Mapping):
        for name, info in layouts.items():
            _component(name, saved[name], info, where)


def type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def describe(components: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's ``layouts``: what :func:`check_state` needs to know of each component
    that its state file alone cannot say. Its type (for people); for types unbroken knows,
    the schema its state follows (``kind``) and what must match at restore: a module's
    non-tensor entries (``extra``), an optimizer's group sizes (``param_groups``), whether a
    scaler was enabled. ``saved``: the components' state dicts as saved."""
    out: dict[str, dict[str, Any]] = {}
    for name, obj in components.items():
        inner = obj
        if isinstance(obj, _ShardedOptimizer):
            inner = obj.optimizer
        elif isinstance(obj, _ShardedModel):
            inner = obj.module
        info: dict[str, Any] = {"type": type_name(inner)}
        kind = _kind(inner)
        sd = saved.get(name)
        if kind is not None and isinstance(sd, Mapping):
            info["kind"] = kind
            if kind == "module":
                info["extra"] = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))
            elif kind == "optimizer" and isinstance(sd.get("param_groups"), list):
                info["param_groups"] = [len(g.get("params", ())) for g in sd["param_groups"]]
            elif kind == "scaler":
                info["enabled"] = bool(sd)
            try:  # a state a save writes must be one its restore accepts
                _component(name, sd, info, "the state being saved")
            except SchemaError as e:
                _unchecked(name, info, e)
                for key in ("kind", "extra", "param_groups", "enabled"):
                    info.pop(key, None)
        out[name] = info
    return out


_told: set[tuple[str, str]] = set()


def _unchecked(name: str, info: Mapping[str, Any], e: SchemaError) -> None:
    """Once per component and type: its state is saved without a layout to check at
    restore (the rehearsal against the live object still checks it there)."""
    if (name, info["type"]) in _told:
        return
    _told.add((name, info["type"]))
    log.warning(
        "component %r (%s): its state does not follow the layout unbroken checks for a torch "
        "%s (%s); it is saved, and checked at restore only by loading it into a copy of the "
        "live object. Please report this: unbroken's check should accept it",
        name, info["type"], info.get("kind"), e,
    )  # fmt: skip


def generators(state: TrainState) -> dict[str, str] | None:
    """The manifest's ``generators``: the numpy generators saved with the RNG, name -> kind
    (None when the RNG is not captured)."""
    if not state.capture_rng:
        return None
    return {n: type(g.bit_generator).__name__ for n, g in state.numpy_generators.items()}
