"""Applying a verified checkpoint to the live state, all or nothing (T-FALL-BACK).

Verification (:mod:`.verify`, :mod:`.schema`) proves a checkpoint intact and applicable
as far as the files alone can tell. What only the live objects can tell is found here,
before the first tensor byte of the live state changes:

1. **fit** (:func:`fit_problems`): keys, shapes, dtypes, optimizer groups, module keys,
   registered numpy generators and their kinds. A checkpoint that does not fit is intact:
   restore refuses with the list, nothing is moved aside.
2. **rehearsal** (:meth:`Plan.rehearse`): every component whose ``load_state_dict`` is not
   torch's tensor loading (scheduler, scaler, loader, extras ...) is given its saved state
   first. One without tensors in its state is applied for real, with a copy of its previous
   state to roll back to; one with tensors is rehearsed on a deep copy (sharing the live
   tensors, which the fill overwrites anyway). CUDA RNG states are set on scratch device
   generators. Any exception: :meth:`Plan.undo` rolls back what was applied and the
   caller tries an older checkpoint (``Checkpointer.restore``).
3. **commit** (:meth:`Plan.commit`): the stored tensors are copied into the live ones,
   then modules and optimizers load (all checked above), counters and RNG are set, and last
   the components whose load has effects outside the process (``MetricLog`` truncates its
   file), so they act only once everything else has been applied.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from unbroken.ckpt import codec
from unbroken.ckpt import rng as _rng
from unbroken.ckpt.state import TrainState, _ShardedModel, _ShardedOptimizer
from unbroken.ckpt.tensor_io import fill
from unbroken.ckpt.verify import Verified, check_fits
from unbroken.common.metrics import MetricLog

__all__ = ["Plan", "fit_problems"]

log = logging.getLogger(__name__)

_TENSOR_LOADERS = (torch.nn.Module, torch.optim.Optimizer, _ShardedModel, _ShardedOptimizer)


def _rng_problems(ver: Verified, state: TrainState) -> list[str]:
    """The numpy generators this run registered, against those the checkpoint holds."""
    if ver.rng is None or not state.capture_rng:
        return []
    saved = ver.rng.get("numpy_generators", {})
    out = []
    for name, g in state.numpy_generators.items():
        kind = type(g.bit_generator).__name__
        if name not in saved:
            out.append(
                f"numpy generator {name!r} is registered but the checkpoint has none of that "
                f"name (it has {sorted(saved)}); register the same generators as when saving"
            )
        elif saved[name].get("bit_generator") != kind:
            out.append(
                f"numpy generator {name!r} is a {kind}, the checkpoint holds a "
                f"{saved[name].get('bit_generator')} state for it"
            )
    return out


def _module_problems(ver: Verified, components: Mapping[str, Any]) -> list[str]:
    """Entries of a module's state that are not tensors (``get_extra_state``): a module
    loads strictly, so both sides must have the same."""
    saved = ver.tree.get("components", {})
    out = []
    for name, obj in components.items():
        if isinstance(obj, torch.nn.Module) and isinstance(saved.get(name), dict):
            live = {k for k, v in obj.state_dict().items() if not isinstance(v, torch.Tensor)}
            mine = {k for k, v in saved[name].items() if not codec.is_ref(v)}
            if live != mine:
                out.append(
                    f"components/{name}: non-tensor entries {sorted(mine)} in the checkpoint, "
                    f"{sorted(live)} live"
                )
    return out


def fit_problems(
    ver: Verified, live: Mapping[str, torch.Tensor], state: TrainState, skip: set[str]
) -> list[str]:
    """Every way ``ver`` does not fit the live state (empty when it fits)."""
    components = {n: None if n in skip else o for n, o in state.components.items()}
    present = {n: o for n, o in components.items() if o is not None}
    return (
        check_fits(ver, live, components)
        + _module_problems(ver, present)
        + _rng_problems(ver, state)
    )


@dataclass
class Plan:
    """One verified checkpoint on its way into ``state`` (see the module docstring)."""

    ver: Verified
    state: TrainState
    targets: dict[str, torch.Tensor]
    skip: set[str]
    sd: dict[str, Any] = field(init=False)
    applied: list[tuple[str, Any]] = field(default_factory=list)
    """(name, previous state) of the components applied early, in order."""

    def __post_init__(self) -> None:
        self.sd = self.ver.decode(self.targets)  # targets are filled in place at commit

    def _order(self) -> tuple[list[str], list[str], list[str]]:
        """Components by when they are applied: early (rehearsed for real), with the
        tensors (after the fill), last (effects outside the process)."""
        early, main, last = [], [], []
        saved = self.ver.tree["components"]
        for name, obj in self.state.components.items():
            if name in self.skip:
                continue
            if isinstance(obj, MetricLog):
                last.append(name)
            elif isinstance(obj, _TENSOR_LOADERS) or codec.tensor_keys(saved.get(name)):
                main.append(name)
            else:
                early.append(name)
        return early, main, last

    def rehearse(self) -> str | None:
        """Apply what can be undone, rehearse the rest; the first failure, or None."""
        early, main, _ = self._order()
        saved = self.sd["components"]
        for name in early:
            obj = self.state.components[name]
            try:
                before = copy.deepcopy(obj.state_dict())
                obj.load_state_dict(saved[name])
            except Exception as e:  # noqa: BLE001 - any refusal of the component's own
                return _failure(name, obj, e)
            self.applied.append((name, before))
        for name in main:
            obj = self.state.components[name]
            if isinstance(obj, _TENSOR_LOADERS):
                continue  # torch's own loading: checked by fit_problems and the schema
            why = self._on_a_copy(name, obj, saved[name])
            if why is not None:
                return why
        return self._cuda_rng()

    def _on_a_copy(self, name: str, obj: Any, sd: Any) -> str | None:
        shared = {id(t): t for t in self.targets.values()}
        shared.update({id(o): o for n, o in self.state.components.items() if n != name})
        try:
            scratch = copy.deepcopy(obj, shared)
        except Exception:  # noqa: BLE001 - not copyable (a lock, a file): applied unrehearsed
            log.debug("component %r cannot be copied: applied without a rehearsal", name)
            return None
        try:
            scratch.load_state_dict(sd)
        except Exception as e:  # noqa: BLE001 - any refusal of the component's own
            return _failure(name, obj, e)
        return None

    def _cuda_rng(self) -> str | None:
        cuda = (self.ver.rng or {}).get("cuda") if self.state.capture_rng else None
        if not cuda or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        for i, st in enumerate(list(cuda)[: torch.cuda.device_count()]):
            try:
                torch.Generator(device=f"cuda:{i}").set_state(st)
            except Exception as e:  # noqa: BLE001 - torch raises RuntimeError or TypeError
                return f"rng: CUDA generator {i} refused its state ({type(e).__name__}: {e})"
        return None

    def undo(self) -> None:
        """Put back the components :meth:`rehearse` applied (newest first)."""
        for name, before in reversed(self.applied):
            try:
                self.state.components[name].load_state_dict(before)
            except Exception as e:  # noqa: BLE001 - keep undoing the others
                log.error("could not roll back component %r after a refused restore: %s", name, e)
        self.applied.clear()

    def commit(self, directory: str) -> None:
        """Copy the stored tensors into the live ones and apply the rest."""
        _, main, last = self._order()
        ver, st = self.ver, self.state
        fill(directory, ver.manifest, self.targets, views=ver.tensors)
        saved = self.sd["components"]
        for name in [*main, *last]:
            try:
                st.components[name].load_state_dict(saved[name])
            except Exception as e:
                raise RuntimeError(
                    f"checkpoint step {ver.step}: component {name!r} failed after the state was "
                    f"partly restored ({type(e).__name__}: {e}); restart the process"
                ) from e
        st.load_counters(self.sd["counters"])
        if ver.rng is not None and st.capture_rng:
            _rng.restore(ver.rng, st.numpy_generators)


def _failure(name: str, obj: Any, e: BaseException) -> str:
    return (
        f"component {name!r} ({type(obj).__qualname__}) refused its state: {type(e).__name__}: {e}"
    )
