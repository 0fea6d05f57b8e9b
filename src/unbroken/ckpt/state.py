"""``TrainState``: the one bundle a run must restore to continue on the same trajectory
(C-COMPLETE).

It holds the counters (``step``, ``samples``, ``tokens``, ``micro_step``), the components
(model, optimizer, scheduler, ema, scaler, loader, metrics, plain ``values`` and
``extra.<name>`` objects) and every RNG stream of the rank. Each component is
``replicated`` or ``per_rank`` (:mod:`unbroken.ckpt.per_rank`, C-PER-RANK).

What a caller must know:

* wrapped models are unwrapped (``DistributedDataParallel.module``, ``torch.compile``'s
  ``_orig_mod``): hand ``TrainState`` the model you train; a checkpoint's keys never depend
  on the wrapper;
* a sharded model (FSDP2, tensor parallel: DTensor parameters) and its optimizer go through
  DCP's ``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict``: re-shardable
  on any world size (C-RESHARD);
* saving is allowed only at an optimizer-step boundary: while ``micro_step != 0``
  :meth:`TrainState.check_saveable` refuses with a clear error.

The state-dict schema: ARCHITECTURE.md, "Design notes" > ckpt > the state of a rank.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

# torch's own protocol (DCP's): every saved object speaks it; re-exported as
# unbroken.ckpt.Stateful for users who annotate their components with it
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from unbroken.ckpt import rng as _rng

__all__ = ["Stateful", "TrainState", "Values", "check_values"]

COUNTERS = ("step", "samples", "tokens", "micro_step")
"""The training loop's counters, saved with every checkpoint."""
_ON_RESIZE = ("refuse", "skip")


# What one ``values`` entry may be, and how many there may be: the file is untrusted, and a
# best loss, an iteration number or a run name need far less.
MAX_VALUES = 1024
MAX_KEY_CHARS = 256
MAX_STR_CHARS = 65_536
_INT64 = 1 << 63


def check_value(key: Any, v: Any, where: str = "values") -> Any:
    """``v`` as stored under ``key`` (a float subclass becomes a float); raises
    ``TypeError``/``ValueError`` naming ``where[key]``, the value and the fix."""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
        shown = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
        raise ValueError(
            f"{where}: key {shown} must be a non-empty string of at most {MAX_KEY_CHARS} characters"
        )
    here = f"{where}[{key!r}]"
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        if not -_INT64 <= v < _INT64:
            raise ValueError(f"{here}={v} is outside int64; store it as a float or a string")
        return int(v)
    if isinstance(v, float):
        return float(v)  # NaN and inf are kept
    if isinstance(v, str):
        if len(v) > MAX_STR_CHARS:
            raise ValueError(
                f"{here} is a string of {len(v)} characters; at most {MAX_STR_CHARS} are kept "
                "(values are for scalars: put large state in a Stateful component)"
            )
        return v
    hint = " (a tensor: store t.item())" if isinstance(v, torch.Tensor) else ""
    raise TypeError(
        f"{here} is a {type(v).__qualname__}{hint}; values hold JSON scalars only (None, bool, "
        "int, float, str): keep other state in a Stateful component"
    )


def check_values(sd: Any, where: str = "values") -> dict[str, Any]:
    """A saved ``values`` state checked as untrusted input (bounded, types checked)."""
    if not isinstance(sd, dict):
        raise TypeError(f"{where} is a {type(sd).__name__}, not a dict of values")
    if len(sd) > MAX_VALUES:
        raise ValueError(f"{where} holds {len(sd)} values; at most {MAX_VALUES} are allowed")
    return {k: check_value(k, v, where) for k, v in sd.items()}


class Values(MutableMapping[str, Any]):
    """Plain values of the training loop (``best_val_loss``, an iteration number, a run
    name): JSON scalars by name, read and written like a dict (``state.values["best"] =
    loss``), saved with every checkpoint (checksummed like all state) and restored by
    :meth:`Checkpointer.restore`. The same on every rank by default (component
    ``values``, replicated: a world-size change restores rank 0's copy on new ranks).

    A value is checked where it is set: None, bool, int (int64), float (NaN and inf
    kept) or str (at most 65,536 characters); at most 1,024 keys of at most 256 characters.
    On restore the saved values replace the live ones; a key the checkpoint does not hold
    keeps its declared default.
    """

    def __init__(self, declared: Mapping[str, Any] | None, *, registered: bool = True) -> None:
        if declared is not None and not isinstance(declared, Mapping):
            raise TypeError(
                f"TrainState(values=...) takes a dict of name -> value, got "
                f"{type(declared).__qualname__}"
            )
        self.registered = registered
        self._declared = check_values(dict(declared or {}), "TrainState values")
        self._d = dict(self._declared)

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if not self.registered:
            raise RuntimeError(
                f"state.values[{key!r}] would not be saved: this TrainState was built "
                "without values=; declare them, e.g. TrainState(..., values={'best_val_loss': "
                "float('inf')})"
            )
        if key not in self._d and len(self._d) >= MAX_VALUES:
            raise ValueError(f"values[{key!r}]: at most {MAX_VALUES} values are allowed")
        self._d[key] = check_value(key, value)

    def __delitem__(self, key: str) -> None:
        del self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"Values({self._d!r})"

    def state_dict(self) -> dict[str, Any]:
        return dict(self._d)

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self._d = {**self._declared, **check_values(sd)}


def _is_sharded(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) and any(
        isinstance(p, DTensor) for p in obj.parameters()
    )


class _ShardedModel:
    """A sharded model through DCP's state-dict helpers (as TorchTitan saves FSDP2)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, sd)


class _ShardedOptimizer:
    """The optimizer of a sharded model: state keyed by parameter name, and initialised
    (DCP steps it once with lr 0) before a restore can load into it."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, sd)


_TENSOR_LOADERS = (torch.nn.Module, torch.optim.Optimizer, _ShardedModel, _ShardedOptimizer)
"""Components that torch's own code loads: tensors of the live shapes and dtypes only (any
other ``Stateful`` takes what it was saved with, or refuses it itself)."""


def _through_dcp(comps: dict[str, Any]) -> None:
    """Route sharded models, and the optimizers that go with them, through DCP's helpers.
    ``optimizer.<x>`` goes with ``model.<x>``, or with the only sharded model there is."""
    models = {n: m for n, m in comps.items() if n.split(".")[0] == "model" and _is_sharded(m)}
    for name, opt in comps.items():
        if name.split(".")[0] != "optimizer" or not isinstance(opt, torch.optim.Optimizer):
            continue
        model = models.get("model" + name.removeprefix("optimizer"))
        if model is None and len(models) == 1:
            model = next(iter(models.values()))
        if model is not None:
            comps[name] = _ShardedOptimizer(model, opt)
    for name, model in models.items():
        comps[name] = _ShardedModel(model)


def _unwrap(obj: Any) -> tuple[Any, set[str], list[Any]]:
    """The module inside DDP / ``torch.compile`` wrappers, the buffer names DDP
    re-broadcasts from rank 0 at every forward (``broadcast_buffers=True``), and the
    process groups the DDP wrappers all-reduce on."""
    from torch.nn.parallel import DistributedDataParallel

    synced: set[str] = set()
    groups: list[Any] = []
    while True:
        if isinstance(obj, DistributedDataParallel):
            if obj.broadcast_buffers:
                synced |= {n for n, _ in obj.module.named_buffers()}
            groups.append(obj.process_group)
            obj = obj.module
        elif type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod"):
            obj = obj._orig_mod  # torch.compile: keys without the "_orig_mod." prefix
        else:
            return obj, synced, groups


class _Generator:
    """A random generator as a component: ``torch.Generator`` (any device),
    ``random.Random`` or ``np.random.Generator``, saved and restored whole, so an extra
    stream (a sampler's, a dropout mask's, an augmentation's) goes on where it was."""

    def __init__(self, name: str, g: Any) -> None:
        self.name, self.g = name, g
        self.kind = (
            "torch" if isinstance(g, torch.Generator)
            else "python" if isinstance(g, random.Random)
            else "numpy"
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        g = self.g
        if self.kind == "torch":
            return {"kind": "torch", "state": g.get_state()}
        if self.kind == "python":
            version, internal, gauss_next = g.getstate()
            return {"kind": "python", "version": version, "state": list(internal),
                    "gauss_next": gauss_next}  # fmt: skip
        bits = g.bit_generator.state  # big integers as decimal strings: JSON holds int64
        return {"kind": "numpy", "state": json.dumps(bits)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        saved = sd.get("kind") if isinstance(sd, Mapping) else None
        if saved != self.kind:
            raise ValueError(
                f"component {self.name!r} was saved from a {saved!r} generator and this run "
                f"registers a {self.kind!r} one: register the same kind as when saving"
            )
        try:
            if self.kind == "torch":
                state = sd["state"]
                if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                    raise TypeError(f"a uint8 tensor, not {type(state).__qualname__}")
                self.g.set_state(state.cpu())
            elif self.kind == "python":
                self.g.setstate((sd["version"], tuple(sd["state"]), sd["gauss_next"]))
            else:
                bits = json.loads(sd["state"])
                if bits.get("bit_generator") != type(self.g.bit_generator).__name__:
                    raise ValueError(
                        f"a {bits.get('bit_generator')!r} bit generator, this run has a "
                        f"{type(self.g.bit_generator).__name__!r}"
                    )
                self.g.bit_generator.state = bits
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
            raise ValueError(
                f"component {self.name!r}: the saved {self.kind} generator state does not "
                f"fit this generator ({type(e).__name__}: {e}); register the generator it "
                "was saved from, or keep it out of the checkpoint"
            ) from None


def _as_component(name: str, obj: Any) -> Any:
    """``obj`` as a component: a random generator wrapped (:class:`_Generator`)."""
    if isinstance(obj, (torch.Generator, random.Random, np.random.Generator)):
        return _Generator(name, obj)
    return obj


def _named(kind: str, obj: Any) -> dict[str, Any]:
    """``model=m`` -> {"model": m}; ``model={"g": g, "d": d}`` -> {"model.g": g, "model.d": d}."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping) and not isinstance(obj, Stateful):
        return {f"{kind}.{name}": v for name, v in obj.items()}
    return {kind: obj}


def _with_plain(values: Mapping[str, Any] | None, plain: dict[str, Any]) -> Any:
    """``values`` plus the keywords that are not components: plain values (JSON scalars). A
    keyword that is not a scalar is a misspelt component, or a value of the wrong kind."""
    for key, v in plain.items():
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise TypeError(
                f"TrainState got {key}={type(v).__qualname__}: not a component "
                f"(model, optimizer, scheduler, ema, scaler, loader, metrics, extras) - a "
                "misspelling? - and not a plain value (keywords other than components are "
                "values: JSON scalars)"
            )
        if values is not None and key in values:
            raise TypeError(f"TrainState got {key!r} both in values= and as a keyword")
    return {**(values or {}), **plain} if plain else values


def _check_components(comps: Mapping[str, Any], numpy_generators: Mapping[str, Any]) -> None:
    for name, obj in comps.items():
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"TrainState component {name!r} is a {type(obj).__qualname__}, which has no "
                "state_dict()/load_state_dict(); wrap it in an object that has both, or "
                "keep it out of the checkpoint"
            )
    for name, g in numpy_generators.items():
        if not isinstance(g, np.random.Generator):
            raise TypeError(
                f"numpy_generators[{name!r}] is a {type(g).__qualname__}; pass "
                "np.random.Generator objects (np.random.default_rng(seed))"
            )


def _sharing(
    comps: Mapping[str, Any], replicated: list[str], per_rank: list[str]
) -> dict[str, str]:
    """Each component's sharing (C-PER-RANK): extras per rank, the others replicated, unless
    ``replicated=``/``per_rank=`` declare otherwise."""
    sharing = {n: "per_rank" if n.startswith("extra.") else "replicated" for n in comps}
    for arg, names in (("replicated", replicated), ("per_rank", per_rank)):
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"{arg}= takes a list of component names, got {names!r}")
        unknown = sorted(set(names) - set(comps))
        if unknown:
            raise ValueError(
                f"{arg}={unknown}: no such component; this TrainState has {sorted(comps)}"
            )
    both = sorted(set(replicated) & set(per_rank))
    if both:
        raise ValueError(f"{both} declared both replicated and per_rank; pick one")
    sharing.update({n: "replicated" for n in replicated})
    sharing.update({n: "per_rank" for n in per_rank})
    return sharing


class TrainState:
    """Everything a run must restore: weights, optimizer, data position, RNG and the rest.

    Args:
        model, optimizer, scheduler: one object or a ``{name: obj}`` dict of several.
        ema: EMA model (e.g. ``torch.optim.swa_utils.AveragedModel``).
        scaler: AMP ``torch.amp.GradScaler``.
        loader: the data loader (``unbroken.data.StatefulLoader`` or any ``Stateful``).
        metrics: ``unbroken.common.metrics.MetricLog`` so the log continues without a repeated segment.
        extras: any further ``Stateful`` objects, by name (component ``extra.<name>``),
            and random generators of their own (``torch.Generator`` of any device,
            ``random.Random``, ``np.random.Generator``), saved and restored whole.
            Per-rank by default: each rank saves and restores its own.
        values: plain values of the loop by name (``{"best_val_loss": float("inf")}``):
            JSON scalars, read and written as ``state.values[name]``, saved and restored
            with the rest, the same on every rank (component ``values``, see :class:`Values`).
            Any other keyword is one more plain value: ``TrainState(model=m,
            best_val_loss=1e9)`` is ``values={"best_val_loss": 1e9}``.
        numpy_generators: ``np.random.Generator`` objects to capture with the RNG state.
        capture_rng: capture python/numpy/torch/CUDA RNG (default True).
        seed: the run's seed; when a checkpoint is restored with another world size,
            per-rank RNG streams are re-derived from ``(seed, rank, step)``.
        replicated: component names (``"extra.stats"``) to declare identical on every
            rank: a difference between ranks is reported at save, and a world-size change
            restores rank 0's copy on new ranks.
        per_rank: component names to declare per-rank (e.g. ``"optimizer"`` when some
            parameters are outside DDP): no report at save, and a world-size change refuses
            them when they differed between the saving ranks.
        per_rank_on_resize: ``"refuse"`` (default) or ``"skip"``: on a world-size change,
            leave per-rank components that cannot be mapped as constructed (WARNING).

    Counters ``step``, ``samples``, ``tokens`` and ``micro_step`` are plain attributes the
    training loop updates; ``values`` holds its other plain values (``state.values``).
    """

    def __init__(
        self,
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        ema: Any = None,
        scaler: Any = None,
        loader: Any = None,
        metrics: Any = None,
        extras: Mapping[str, Any] | None = None,
        values: Mapping[str, Any] | None = None,
        numpy_generators: Mapping[str, np.random.Generator] | None = None,
        capture_rng: bool = True,
        seed: int = 0,
        replicated: Iterable[str] = (),
        per_rank: Iterable[str] = (),
        per_rank_on_resize: str = "refuse",
        **plain: Any,
    ) -> None:
        values = _with_plain(values, plain)
        comps: dict[str, Any] = {}
        for kind, obj in (
            ("model", model),
            ("optimizer", optimizer),
            ("scheduler", scheduler),
            ("ema", ema),
            ("scaler", scaler),
            ("loader", loader),
            ("metrics", metrics),
        ):
            comps.update(_named(kind, obj))
        for name, obj in (extras or {}).items():
            comps[f"extra.{name}"] = _as_component(f"extra.{name}", obj)
        self.values = Values(values, registered=values is not None)
        if values is not None:
            comps["values"] = self.values
        self.synced_buffers: dict[str, set[str]] = {}
        self.process_groups: list[Any] = []
        """The groups the state's DDP wrappers all-reduce on (the Checkpointer holds them
        until exit: ``Comm.destroy``)."""
        for name, obj in comps.items():
            comps[name], synced, groups = _unwrap(obj)
            if synced:
                self.synced_buffers[name] = synced
            self.process_groups += groups
        _through_dcp(comps)
        _check_components(comps, numpy_generators or {})
        self.components = comps
        self.sharing = _sharing(comps, list(replicated), list(per_rank))
        if per_rank_on_resize not in _ON_RESIZE:
            raise ValueError(
                f"per_rank_on_resize={per_rank_on_resize!r}; pass one of {list(_ON_RESIZE)}"
            )
        self.per_rank_on_resize = per_rank_on_resize
        self.numpy_generators = dict(numpy_generators or {})
        self.capture_rng = capture_rng
        self.seed = int(seed)
        self.step = 0
        self.samples = 0
        self.tokens = 0
        self.micro_step = 0

    # --- the Stateful protocol ------------------------------------------------------------

    def check_saveable(self) -> None:
        if self.micro_step != 0:
            raise RuntimeError(
                f"refusing to checkpoint at step {self.step} in the middle of a gradient-"
                f"accumulation cycle (micro_step={self.micro_step}): the partial gradients "
                "would be lost. Save right after optimizer.step() and reset micro_step to 0."
            )

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "counters": {k: int(getattr(self, k)) for k in COUNTERS},
            "components": {name: obj.state_dict() for name, obj in self.components.items()},
        }
        if self.capture_rng:
            sd["rng"] = _rng.capture(self.numpy_generators)
        return sd

    def check_compatible(self, sd: Mapping[str, Any]) -> None:
        """Raise before anything is applied if ``sd`` has other components than this state."""
        saved = sd["components"]
        missing = sorted(set(self.components) - set(saved))
        extra = sorted(set(saved) - set(self.components))
        if missing or extra:
            raise ValueError(
                f"checkpoint components do not match this TrainState: missing from checkpoint "
                f"{missing}, present only in checkpoint {extra}; construct TrainState with the "
                "same components as the run that saved it"
            )

    def load_counters(self, counters: Mapping[str, Any]) -> None:
        for k in COUNTERS:
            setattr(self, k, int(counters[k]))

    def load_state_dict(
        self, sd: Mapping[str, Any], *, restore_rng: bool = True, skip: Iterable[str] = ()
    ) -> None:
        """Apply ``sd``; components named in ``skip`` keep their current state."""
        self.check_compatible(sd)
        saved = sd["components"]
        skip = set(skip)
        for name, obj in self.components.items():
            if name not in skip:
                obj.load_state_dict(saved[name])
        self.load_counters(sd["counters"])
        if restore_rng and self.capture_rng and "rng" in sd:
            _rng.restore(sd["rng"], self.numpy_generators)
