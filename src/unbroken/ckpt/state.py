"""``TrainState``: the one bundle a run must restore to continue on the same trajectory.

State dict schema (what a checkpoint holds)::

    {
      "counters": {"step", "samples", "tokens", "micro_step"},
      "components": {"model": ..., "optimizer": ..., "scheduler": ..., "ema": ...,
                     "scaler": ..., "loader": ..., "metrics": ..., "extra.<name>": ...},
      "rng": {python, numpy, numpy_generators, torch, cuda}      # per rank
    }

Each component is declared ``replicated`` (the same on every rank: model, optimizer,
scheduler, ema, scaler, loader, metrics) or ``per_rank`` (extras, unless declared otherwise);
whatever actually differs between ranks is saved per rank and restored to the same rank,
and a world-size change follows the rule in :mod:`unbroken.ckpt.per_rank`.

Wrapped models are unwrapped (``DistributedDataParallel.module``, ``torch.compile``'s
``_orig_mod``), so a checkpoint's keys never depend on the wrapper: hand ``TrainState``
the model you train. A sharded model (FSDP2 ``fully_shard``, tensor parallel: DTensor
parameters) and its optimizer go through DCP's ``get_model_state_dict`` /
``get_optimizer_state_dict`` (and the ``set_`` pair): parameter-name keys, re-shardable on
any world size, and an optimizer that has not stepped yet can be restored into.

Saving is allowed only at an optimizer-step boundary (DESIGN C-COMPLETE): while
``micro_step != 0`` the gradients of an unfinished accumulation cycle live only in
``.grad`` buffers, and :meth:`TrainState.check_saveable` refuses with a clear error rather
than silently dropping them. The counter is still saved so a resumed run knows where it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

# torch's own protocol (DCP's): every saved object speaks it; re-exported as
# unbroken.ckpt.Stateful for users who annotate their components with it
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from unbroken.ckpt import rng as _rng

__all__ = ["Stateful", "TrainState"]

COUNTERS = ("step", "samples", "tokens", "micro_step")
"""The training loop's counters, saved with every checkpoint."""
_ON_RESIZE = ("refuse", "skip")


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


def _unwrap(obj: Any) -> tuple[Any, set[str]]:
    """The module inside DDP / ``torch.compile`` wrappers, and the buffer names DDP
    re-broadcasts from rank 0 at every forward (``broadcast_buffers=True``)."""
    from torch.nn.parallel import DistributedDataParallel

    synced: set[str] = set()
    while True:
        if isinstance(obj, DistributedDataParallel):
            if obj.broadcast_buffers:
                synced |= {n for n, _ in obj.module.named_buffers()}
            obj = obj.module
        elif type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod"):
            obj = obj._orig_mod  # torch.compile: keys without the "_orig_mod." prefix
        else:
            return obj, synced


def _named(kind: str, obj: Any) -> dict[str, Any]:
    """``model=m`` -> {"model": m}; ``model={"g": g, "d": d}`` -> {"model.g": g, "model.d": d}."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping) and not isinstance(obj, Stateful):
        return {f"{kind}.{name}": v for name, v in obj.items()}
    return {kind: obj}


class TrainState:
    """Everything a run must restore: weights, optimizer, data position, RNG and the rest.

    Args:
        model, optimizer, scheduler: one object or a ``{name: obj}`` dict of several.
        ema: EMA model (e.g. ``torch.optim.swa_utils.AveragedModel``).
        scaler: AMP ``torch.amp.GradScaler``.
        loader: the data loader (``unbroken.data.StatefulLoader`` or any ``Stateful``).
        metrics: ``unbroken.common.metrics.MetricLog`` so the log continues without a repeated segment.
        extras: any further ``Stateful`` objects, by name (component ``extra.<name>``).
            Per-rank by default: each rank saves and restores its own.
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
    training loop updates.
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
        numpy_generators: Mapping[str, np.random.Generator] | None = None,
        capture_rng: bool = True,
        seed: int = 0,
        replicated: Iterable[str] = (),
        per_rank: Iterable[str] = (),
        per_rank_on_resize: str = "refuse",
    ) -> None:
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
            comps[f"extra.{name}"] = obj
        self.synced_buffers: dict[str, set[str]] = {}
        for name, obj in comps.items():
            comps[name], synced = _unwrap(obj)
            if synced:
                self.synced_buffers[name] = synced
        _through_dcp(comps)
        for name, obj in comps.items():
            if not isinstance(obj, Stateful):
                raise TypeError(
                    f"TrainState component {name!r} is a {type(obj).__qualname__}, which has no "
                    "state_dict()/load_state_dict(); wrap it in an object that has both, or "
                    "keep it out of the checkpoint"
                )
        for name, g in (numpy_generators or {}).items():
            if not isinstance(g, np.random.Generator):
                raise TypeError(
                    f"numpy_generators[{name!r}] is a {type(g).__qualname__}; pass "
                    "np.random.Generator objects (np.random.default_rng(seed))"
                )
        self.components = comps
        self.sharing = {n: "per_rank" if n.startswith("extra.") else "replicated" for n in comps}
        replicated, per_rank = list(replicated), list(per_rank)
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
        self.sharing.update({n: "replicated" for n in replicated})
        self.sharing.update({n: "per_rank" for n in per_rank})
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
