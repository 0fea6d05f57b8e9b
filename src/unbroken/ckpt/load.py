"""How a checkpoint gets into the live state: verified on every rank, agreed, checked
against the live objects, rehearsed, applied; all or nothing (T-FALL-BACK, C-PER-RANK).

:meth:`Loader.try_load` runs one candidate step on every rank:

1. **verify** (:func:`.verify.load_verified`, the same code as ``ckpt verify``); damage on
   any rank moves the step aside (:meth:`Loader.quarantine`);
2. **fit** (:func:`fit_problems`, with the world-size rule of :mod:`.per_rank`): a
   checkpoint that does not fit is intact, and raises :class:`.store.RestoreRefused` (a
   ``ValueError``) with the list; nothing moved aside, nothing changed;
3. **rehearsal** (:meth:`Plan.rehearse`): every component whose ``load_state_dict`` is
   not torch's tensor loading is given its saved state first; a refusal on any rank rolls
   back what was applied (:meth:`Plan.undo`) and the step is reported refused;
4. **commit** (:meth:`Plan.commit`): tensors, then modules and optimizers, counters and
   RNG, and last the components whose load has effects outside the process.

Which step to try, the archive and a fresh start are the :class:`Checkpointer`'s. What
each phase checks and why the commit runs in that order: ARCHITECTURE.md, "Design notes" >
ckpt > restore.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from unbroken.ckpt import codec, per_rank
from unbroken.ckpt import rng as _rng
from unbroken.ckpt.collectives import Comm
from unbroken.ckpt.manifest import CheckpointManifest, TensorEntry, split_key
from unbroken.ckpt.say import say
from unbroken.ckpt.state import _TENSOR_LOADERS, TrainState
from unbroken.ckpt.store import CorruptCheckpoint, RestoreRefused, Store
from unbroken.ckpt.tensor_io import fill
from unbroken.ckpt.verify import Verified, check_fits, load_verified
from unbroken.common.metrics import MetricLog
from unbroken.common.text import printable

__all__ = ["Loader", "NotLoaded", "Plan", "fit_problems", "refusal"]

log = logging.getLogger(__name__)


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


class Loader:
    """Loads checkpoints of ``store`` into ``state`` with ``comm``'s ranks."""

    def __init__(
        self, store: Store, state: TrainState, comm: Comm, audit: Any, *, quiet: bool = False
    ) -> None:
        self.store, self.state, self.comm = store, state, comm
        self.audit = audit  # `unbroken drill`'s state fingerprints; a no-op otherwise
        self.quiet = quiet  # fall-back lines at DEBUG only (see .say)
        self.applied: CheckpointManifest | None = None
        """The manifest of the checkpoint the last successful :meth:`try_load` applied."""

    def try_load(self, s: int) -> NotLoaded | None:
        """Verify ``s`` on every rank and apply it only if all agree. Returns None when it
        was applied, else why not: damaged (quarantined or skipped already), or refused by
        the live state (left in place: the caller decides once an older one applies)."""
        rank, world = self.comm.rank, self.comm.world
        ver: Verified | None = None
        why = None
        try:
            ver = load_verified(self.store, s, rank=rank, world=world)
        except CorruptCheckpoint as e:  # load_verified raises nothing else for damage
            why = (e.reason, e.detail)
        verdicts = self.comm.gather(why)
        bad = [(r, w) for r, w in enumerate(verdicts) if w]
        if bad:
            r, (reason, detail) = bad[0]
            self.quarantine(s, reason, f"rank {r}: {reason}: {detail}")
            return NotLoaded(f"{reason}: {detail}")
        if ver is None:  # unreachable: no rank reported damage
            return NotLoaded("not verified")
        return self._apply(ver)

    def quarantine(self, s: int, reason: str, why: str, then: str = "trying an older one") -> None:
        """Move damaged step ``s`` aside (rank 0), one line (:func:`.say`: a WARNING, or
        stderr); every rank waits for it."""
        if self.comm.rank == 0:
            where = self.store.quarantine(s, reason)
            if isinstance(where, OSError):
                say(
                    log, logging.WARNING,
                    "checkpoint step %d is damaged (%s); could not move it aside (%s), "
                    "skipped; %s",
                    s, why, str(where.strerror or where), then, quiet=self.quiet,
                )  # fmt: skip
            else:
                say(
                    log, logging.WARNING,
                    "checkpoint step %d is damaged (%s); moved to %s, %s",
                    s, why, where, then, quiet=self.quiet,
                )  # fmt: skip
        self.comm.barrier()

    def apply(self, ver: Verified) -> NotLoaded | None:
        """Apply ``ver``, verified elsewhere (the memory tier's slots, :mod:`.memtier`):
        fit, rehearsal and commit as for a disk step; collective."""
        return self._apply(ver)

    def _apply(self, ver: Verified) -> NotLoaded | None:
        # The world-size rule (C-PER-RANK) is a refusal, like the fit below: it raises
        # to the caller and never quarantines the (intact) checkpoint.
        skip = per_rank.check_resize(ver.manifest, self.state, self.comm.world, self.comm.rank)
        if skip:  # neither read nor decoded: those components keep their live state
            comps = {n: None if n in skip else v for n, v in ver.tree["components"].items()}
            tree = {**ver.tree, "components": comps}
            ver = dataclasses.replace(ver, tree=tree, needed=ver.needed & codec.tensor_keys(tree))
        live = self._live_tensors(ver)
        self._check_fit(ver, live, skip)
        tensors = ver.manifest.tensors
        targets = {  # what this rank's state references: live tensors, or new ones
            k: live[k]
            if k in live and _takes(live[k], tensors[k])
            else torch.empty(tensors[k].shape, dtype=tensors[k].torch_dtype)
            for k in sorted(ver.needed)
        }
        plan = Plan(ver, self.state, targets, skip)
        refusals = self.comm.gather(plan.rehearse())  # before the first tensor byte changes
        if any(refusals):
            plan.undo()
            r, why = next((r, w) for r, w in enumerate(refusals) if w)
            return NotLoaded(f"rank {r}: {why}", refused=True)
        plan.commit(self.store.step_dir(ver.step))
        if ver.rng is None and self.state.capture_rng:  # capture_rng=False: left alone
            self._derive_rng(ver)
        self.audit.restored(ver.step)
        self.applied = ver.manifest
        return None

    def difference(self, s: int) -> str | None:
        """How the live state differs from committed step ``s`` on any rank (the first
        difference, as ``rank r: <path>``), or None when every rank's state is bit-identical
        to what it saved. Collective; one verified read of the checkpoint, nothing applied."""
        try:
            ver = load_verified(self.store, s, rank=self.comm.rank, world=self.comm.world)
            if ver.rng is None:
                raise ValueError(f"saved by {ver.manifest.world_size} ranks")
            tensors = ver.manifest.tensors
            saved = {
                k: torch.empty(tensors[k].shape, dtype=tensors[k].torch_dtype)
                for k in sorted(ver.needed)
            }
            sd = ver.decode(saved)
            fill(self.store.step_dir(s), ver.manifest, saved, views=ver.tensors)
            mine = codec.first_difference(self.state.state_dict(), sd)
        except (CorruptCheckpoint, ValueError) as e:
            mine = f"{type(e).__name__}: {e}"
        found = [(r, d) for r, d in enumerate(self.comm.gather(mine)) if d is not None]
        return None if not found else printable(f"rank {found[0][0]}: {found[0][1]}")

    def _check_fit(self, ver: Verified, live: dict[str, torch.Tensor], skip: set[str]) -> None:
        """All or nothing: every key, shape and dtype is checked on every rank before the
        first tensor is copied into the live state. Skipped components are not compared."""
        mine = fit_problems(ver, live, self.state, skip)
        problems = [p for ps in self.comm.gather(mine) for p in ps]
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise RestoreRefused(
                f"checkpoint step {ver.step} in {self.store.root!r} does not fit the live "
                f"state: {'; '.join(sorted(set(problems))[:5])}{more}. Nothing was restored "
                "(the live state is unchanged); build the model and optimizer as the run "
                "that saved it did, or restore from another directory",
                ver.step,
            )

    def _derive_rng(self, ver: Verified) -> None:
        """Saved with another world size (or without RNG): per-rank streams from
        (seed, rank, step)."""
        rank = self.comm.rank
        _rng.derive(self.state.seed, rank, ver.step, self.state.numpy_generators)
        if rank == 0:
            saved, world = ver.manifest.world_size, self.comm.world
            why = (
                f"world size changed ({saved} -> {world} ranks)"
                if saved != world
                else f"checkpoint step {ver.step} holds no RNG state (saved with capture_rng=False)"
            )
            log.warning(
                "%s: per-rank RNG streams re-derived from (seed=%d, rank, step=%d)",
                why,
                self.state.seed,
                ver.step,
            )

    def _live_tensors(self, ver: Verified) -> dict[str, torch.Tensor]:
        """The live state's tensors by checkpoint key; ``rank1/components/x`` (this rank's
        own copy in the checkpoint) restores into the live ``components/x``."""
        current = self.state.state_dict()
        current.pop("rng", None)
        live: dict[str, torch.Tensor] = {}
        codec.encode(current, live)
        for k in ver.needed:
            base = split_key(k)[1]
            if base != k and base in live:
                live[k] = live.pop(base)
        return live


def _takes(t: torch.Tensor, stored: TensorEntry) -> bool:
    """Can live ``t`` take the stored values in place? Not when it has another shape or
    dtype (a plain ``Stateful`` whose state grows: ``fit_problems`` let it through), nor
    when it is expanded (two elements at one address: ``copy_`` refuses it, half-way
    through the fill); its component gets a new tensor instead."""
    if tuple(t.shape) != stored.shape or t.dtype != stored.torch_dtype:
        return False
    if t.layout != torch.strided:
        return True
    return all(stride or size < 2 for stride, size in zip(t.stride(), t.shape, strict=True))


@dataclass(frozen=True)
class NotLoaded:
    """Why a checkpoint was not applied; ``refused``: intact, but the live state refused it."""

    text: str
    refused: bool = False


def refusal(step: int, why: str, root: str, count: int = 1) -> str:
    others = f" (and {count - 1} older one(s) the same way)" if count > 1 else ""
    return printable(
        f"checkpoint step {step} in {root!r} cannot be applied to the live state{others}: "
        f"{why}. Nothing was restored (the live state is unchanged) and nothing was moved "
        "aside; construct the components as the run that saved it did (the same data, seed "
        "and types), or restore from another directory"
    )
