"""Per-rank state (C-PER-RANK): whatever differs between ranks is saved per rank.

Every :class:`~unbroken.ckpt.TrainState` component is declared ``replicated`` (model,
optimizer, scheduler, ema, scaler, loader, metrics by default) or ``per_rank`` (extras by
default); ``TrainState(replicated=[...], per_rank=[...])`` overrides either way.

:func:`split` (at save) finds, with one all-gather of fingerprints, the tensors and
components that differ between ranks: a tensor that differs is saved by every rank under
``rank<r>/<key>`` and restored to the same rank; a *replicated* component that differs is
reported by name (WARNING; INFO for buffers DDP re-broadcasts). :func:`check_resize`
applies the world-size rule at restore: rank ``r`` reads rank ``r``'s state if ``r < W``,
else rank 0's; RNG re-derived from ``(seed, rank, step)``; a ``per_rank`` component that
differed is refused by name unless ``TrainState(per_rank_on_resize="skip")``.

The full rule, and the manifest fields this module adds (``components``, ``rank``):
ARCHITECTURE.md, "Design notes" > ckpt > per-rank state.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from unbroken.ckpt import codec
from unbroken.ckpt.manifest import (
    COMPONENTS,
    CheckpointManifest,
    component_of,
    component_prefix,
    rank_key,
)
from unbroken.ckpt.store import RestoreRefused
from unbroken.common.fs import checksum_bytes

if TYPE_CHECKING:
    from unbroken.ckpt.collectives import Comm
    from unbroken.ckpt.state import TrainState

__all__ = [
    "NON_TENSOR",
    "check_resize",
    "compare",
    "fingerprints",
    "manifest_section",
    "rename",
    "report",
    "split",
]

log = logging.getLogger(__name__)

NON_TENSOR = "<non-tensor state>"
_PROCESS = os.urandom(8).hex()  # unique to this process


def split(
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    state: TrainState,
    comm: Comm,
    step: int,
    warned: set[str],
) -> tuple[Any, dict[str, torch.Tensor], dict[str, list[str]]]:
    """What this rank saves: every rank's state compared (one all-gather of fingerprints);
    what differs keeps this rank's own key, in ``tensors`` and in the tree's references
    (see the module docstring). Returns ``(tree, tensors, differing)``; on rank 0, a
    replicated component that differs is reported (once per component in ``warned``)."""
    if comm.world < 2:
        return tree, dict(tensors), {}
    mine = fingerprints(tree["components"], tensors, state.sharing)
    differing = compare(comm.gather(mine))
    if comm.rank == 0:
        report(step, differing, state, warned)
    tree, tensors = rename(tree, tensors, differing, comm.rank)
    return tree, tensors, differing


def _component(key: str, names: Mapping[str, str]) -> str | None:
    """The component a shared tensor key belongs to, by its name as keys spell it."""
    return names.get(component_of(key)) if key.startswith(COMPONENTS) else None


def _digest(t: torch.Tensor) -> str:
    try:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
    except (RuntimeError, TypeError):  # a layout without plain bytes (sparse, quantized)
        return f"unhashable:{_PROCESS}"  # differs between ranks: each keeps its own copy
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{checksum_bytes(raw)}"


def fingerprints(
    components: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], sharing: Mapping[str, str]
) -> dict[str, dict[str, str]]:
    """``{component: {tensor key: digest}}`` of this rank's plain tensors, plus the digest
    of each per-rank component's non-tensor state under :data:`NON_TENSOR`.

    ``components`` is the encoded ``"components"`` tree (tensor references, not values)."""
    names = {component_of(component_prefix(n)): n for n in components}
    out: dict[str, dict[str, str]] = {n: {} for n in components}
    for key, t in tensors.items():
        name = _component(key, names)
        if name is not None and not isinstance(t, DTensor):
            out[name][key] = _digest(t)
    for name, sub in components.items():
        if sharing.get(name) == "per_rank":
            out[name][NON_TENSOR] = checksum_bytes(json.dumps(sub, sort_keys=True).encode())
    return out


def compare(ranks: Sequence[Mapping[str, Mapping[str, str]]]) -> dict[str, list[str]]:
    """``{component: [keys whose fingerprints differ between ranks]}`` (differing only).

    A key (or a whole component) that some ranks do not have differs: those that have it
    each keep their own copy."""
    out: dict[str, list[str]] = {}
    for name in sorted({n for fp in ranks for n in fp}):
        present = [fp.get(name, {}) for fp in ranks]
        keys = sorted({k for fp in present for k in fp})
        bad = [k for k in keys if len({fp.get(k) for fp in present}) > 1]
        if bad:
            out[name] = bad
    return out


def rename(
    tree: Any, tensors: Mapping[str, torch.Tensor], differing: Mapping[str, list[str]], rank: int
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Give this rank's copy of every differing tensor its own key, in ``tensors`` and in
    the tree's references."""
    mapping = {k: rank_key(k, rank) for keys in differing.values() for k in keys if k in tensors}
    if not mapping:
        return tree, dict(tensors)
    return codec.rekey(tree, mapping), {mapping.get(k, k): v for k, v in tensors.items()}


def _short(name: str, key: str) -> str:
    """A tensor key as the component's own state-dict path (``0.running_mean``)."""
    if key == NON_TENSOR:
        return key
    return key.removeprefix(component_prefix(name))


def report(
    step: int,
    differing: Mapping[str, list[str]],
    state: TrainState,
    warned: set[str],
) -> None:
    """Say which replicated components differ between ranks (rank 0, once per component)."""
    for name, keys in differing.items():
        if state.sharing.get(name, "per_rank") != "replicated" or name in warned:
            continue
        warned.add(name)
        short = [_short(name, k) for k in keys]
        synced = state.synced_buffers.get(name, set())
        if synced and set(short) <= synced:
            log.info(
                "checkpoint step %d: buffers of %r differ between ranks (%s); DDP re-broadcasts "
                "them from rank 0 at the next forward. Every rank's copy was saved",
                step,
                name,
                ", ".join(short[:5]),
            )
            continue
        log.warning(
            "checkpoint step %d: %r is declared replicated but differs between ranks (%d "
            "tensor(s), e.g. %s). Every rank's copy was saved and each rank restores its own. "
            "If it is per-rank by design, declare TrainState(per_rank=[%r]); if not, the ranks "
            "are out of sync (a parameter outside DDP, a rank-dependent update)",
            step,
            name,
            len(short),
            ", ".join(repr(s) for s in short[:3]),
            name,
        )


def manifest_section(
    differing: Mapping[str, list[str]], sharing: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """The manifest's ``"components"`` entry (see the module docstring)."""
    return {
        name: {
            "sharing": how,
            "differs": name in differing,
            "differing": [_short(name, k) for k in differing.get(name, [])],
        }
        for name, how in sorted(sharing.items())
    }


def check_resize(
    manifest: CheckpointManifest, state: TrainState, world: int, rank: int
) -> set[str]:
    """Apply the world-size rule before anything is restored: returns the per-rank
    components to leave as constructed, or raises :class:`.store.RestoreRefused` naming the ones that
    cannot be mapped to the new ranks."""
    saved_world = manifest.world_size
    comps = manifest.extra.get("components")
    if saved_world == world or not isinstance(comps, Mapping):
        return set()
    per_rank: list[str] = []  # differed between the saving ranks: no rank-to-rank mapping
    copied: list[str] = []  # per-rank, but saved by one rank: every rank starts from it
    differed: list[str] = []  # replicated, yet differed: rank r's copy, else rank 0's
    for name, how in sorted(state.sharing.items()):
        info = comps.get(name)
        differs = bool(info.get("differs")) if isinstance(info, Mapping) else False
        if how == "per_rank" and differs:
            per_rank.append(name)
        elif how == "per_rank" and saved_world < 2:
            copied.append(name)
        elif differs:
            differed.append(name)
    step = manifest.step
    if per_rank and state.per_rank_on_resize == "refuse":
        raise RestoreRefused(
            f"checkpoint step {step} was saved by {saved_world} ranks and this job has "
            f"{world}: per-rank state {per_rank} differs between the saving ranks, so it "
            f"cannot be mapped to the new ranks. Resume with {saved_world} ranks; or pass "
            "TrainState(per_rank_on_resize='skip') to leave it as constructed (each rank "
            "starts it fresh)",
            step,
        )
    if rank == 0:
        if copied:
            log.warning(
                "world size changed (%d -> %d ranks): per-rank state %s was saved by a single "
                "rank; every rank starts from that copy (declare it TrainState(replicated=...) "
                "if it is the same on every rank)",
                saved_world,
                world,
                copied,
            )
        if per_rank:
            log.warning(
                "world size changed (%d -> %d ranks): per-rank state %s not restored, each "
                "rank keeps it as constructed (per_rank_on_resize='skip')",
                saved_world,
                world,
                per_rank,
            )
        if differed:
            log.warning(
                "world size changed (%d -> %d ranks): %s differed between the saving ranks; "
                "rank r restores rank r's copy where that rank existed, else rank 0's",
                saved_world,
                world,
                differed,
            )
    return set(per_rank)  # to skip: refusal was not asked for
