"""Reading a checkpoint back: full verification and decoding before anything is applied
(C-VERIFIED, T-FALL-BACK, T-NO-CODE, T-BOUNDED).

:func:`load_verified` is the one implementation behind ``Checkpointer.restore()``,
``unbroken ckpt verify``, ``ckpt export`` and :func:`read_checkpoint`, so their verdicts
always agree. It checks, cheapest first, the manifest, the files' sizes, this rank's state
file, DCP's ``.metadata`` (without running anything it names), the tensor data (checksums
and statistics) and whether the state tree can be applied, charging every parse to the
checkpoint's memory budget (:mod:`unbroken.ckpt.bounds`).

ANY failure (whatever its exception type, except ``KeyboardInterrupt``/``SystemExit``)
raises :class:`CorruptCheckpoint` with a short reason slug used in quarantine names.
:func:`check_fits` then compares a verified checkpoint with the live state (keys, shapes,
dtypes, optimizer parameter groups), so restore copies nothing unless everything fits.

The checks one by one: ARCHITECTURE.md, "Design notes" > ckpt > verification.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.ckpt import codec
from unbroken.ckpt.bounds import Budget, TooCostly, load_json
from unbroken.ckpt.dcp_metadata import UnsafeMetadata, check_dcp_metadata
from unbroken.ckpt.manifest import (
    METADATA,
    CheckpointManifest,
    FileEntry,
    ManifestError,
    component_of,
)
from unbroken.ckpt.schema import SchemaError, check_state
from unbroken.ckpt.state import _TENSOR_LOADERS
from unbroken.ckpt.stats import LEGACY_STATS_ALGO, STATS_ALGO, stats_close, stats_match
from unbroken.ckpt.store import CorruptCheckpoint, Store
from unbroken.ckpt.tensor_io import ChecksumError, read_tensors, tensor_checksum, verify_files
from unbroken.common.fs import checksum_bytes, path_str

__all__ = ["Verified", "check_fits", "load_verified", "read_checkpoint"]

_ANY = torch.empty(0)  # stands for every stored tensor while the state tree is test-decoded


@dataclass(frozen=True)
class Verified:
    """A fully verified checkpoint, not yet applied.

    ``tensors`` are read-only zero-copy views (see :func:`read_tensors`); empty when the
    checkpoint is sharded (each rank then reads the chunks its shards need). ``rng`` is None
    when the checkpoint was saved with another world size (per-rank streams are re-derived).
    """

    step: int
    manifest: CheckpointManifest
    tree: Any
    tensors: dict[str, torch.Tensor]
    rng: Any
    needed: frozenset[str] = frozenset()
    """The stored tensors this rank's state references (what restore copies)."""

    @property
    def sharded(self) -> bool:
        return self.manifest.sharded

    def decode(self, tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """The state dict; with no ``tensors`` given, owned copies of every tensor."""
        if tensors is None:
            tensors = {k: v.clone() for k, v in self.tensors.items()}
        sd = codec.decode(self.tree, tensors)
        if self.rng is not None:
            sd["rng"] = self.rng
        return sd


def load_verified(
    store: Store,
    step: int,
    *,
    rank: int = 0,
    world: int = 1,
    every_rank: bool = False,
    deep: bool = False,
) -> Verified:
    """Read, fully verify and decode ``step`` for ``rank`` of ``world``; raises
    :class:`CorruptCheckpoint` for any damage, never another exception type.
    ``every_rank``: also verify and decode every other rank's state file (what the ranks
    of a restore at the saved world size check between them; ``ckpt verify`` does this).
    ``deep``: also recompute the per-tensor checksums (version 4) or statistics (version 3)
    the manifest records (``ckpt verify --deep``). A restore does not: ``chunked-f64`` statistics were
    computed from the very bytes the checksums cover, so once those match they can only
    disagree with a manifest edited and re-signed (issue 23 item 1; ARCHITECTURE.md, "What
    the statistics add"). Legacy ``torch-v1`` statistics, computed apart from the written
    bytes, are always checked."""
    try:
        return _load_verified(store, step, rank, world, every_rank, deep)
    except (CorruptCheckpoint, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        reason = (
            e.reason
            if isinstance(e, ManifestError)
            else "checksum"
            if isinstance(e, ChecksumError)
            else "metadata"
            if isinstance(e, UnsafeMetadata)
            else "too-large"
            if isinstance(e, TooCostly)
            else "unreadable"
        )
        detail = (
            str(e)
            if isinstance(e, ChecksumError | ManifestError | UnsafeMetadata | TooCostly)
            else (f"{store.step_dir(step)}: {type(e).__name__}: {e}")
        )
        raise CorruptCheckpoint(step, reason, detail.splitlines()[0] if detail else "") from e


class _Refs(dict[str, torch.Tensor]):
    """The stored tensors by key, recording which ones the state tree references."""

    def __init__(self, keys: Iterable[str]) -> None:
        super().__init__(dict.fromkeys(keys, _ANY))
        self.seen: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.seen.add(key)
        return super().__getitem__(key)


def _read_checked(directory: str, name: str, want: FileEntry) -> bytes:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ChecksumError(path, "is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(want.size + 1)
    finally:
        os.close(fd)
    if len(raw) != want.size or checksum_bytes(raw) != want.checksum:
        raise ChecksumError(path, "checksum mismatch (bit rot or a torn write)")
    return raw


def _load_verified(
    store: Store, step: int, rank: int, world: int, every_rank: bool, deep: bool
) -> Verified:
    budget = Budget(store.file_bytes(step))  # what parsing its files may cost (T-BOUNDED)
    m = store.read_manifest(step, budget)
    d = store.step_dir(step)
    m.check_files(d)
    mine = rank if rank < m.world_size else 0
    raw = _read_checked(d, m.ranks[mine], m.files[m.ranks[mine]])
    if every_rank:
        for r, other in sorted(m.ranks.items()):
            if r != mine:
                with budget.scope():
                    raw_r = _read_checked(d, other, m.files[other])
                    _decode_state(step, d, r, raw_r, m, world, budget)
    where = os.path.join(d, METADATA)
    with budget.scope():
        check_dcp_metadata(_read_checked(d, METADATA, m.files[METADATA]), where, budget)
    tensors: dict[str, torch.Tensor] = {}
    if m.sharded:
        verify_files(d, m, m.data_files[rank::world])
    else:
        stats = m.stats_algo == LEGACY_STATS_ALGO or (deep and m.stats_algo == STATS_ALGO)
        tensors, computed = read_tensors(d, m, with_stats=stats)
        for k, t in tensors.items() if stats else ():
            want = m.tensors[k].stats
            if not (
                stats_close(want, computed[k], t.numel())
                if k in computed
                else stats_match(want, t, m.stats_algo)
            ):
                raise CorruptCheckpoint(
                    step, "stats", f"tensor {k!r} in {d} does not match its recorded sum/norm"
                )
        for k, t in tensors.items() if deep else ():
            want_sum = m.tensors[k].checksum  # version 4
            if want_sum is not None and tensor_checksum(t) != want_sum:
                raise CorruptCheckpoint(
                    step, "checksum", f"tensor {k!r} in {d} does not match its recorded checksum"
                )
    tree, rng, needed = _decode_state(step, d, mine, raw, m, world, budget)
    return Verified(step, m, tree, tensors, rng, needed)


def _decode_state(
    step: int, d: str, rank: int, raw: bytes, m: CheckpointManifest, world: int, budget: Budget
) -> tuple[Any, Any, frozenset[str]]:
    """The state tree, RNG and referenced tensor keys of ``rank``'s state file, decoded as
    restore will decode them and checked as restore will apply them
    (:func:`~unbroken.ckpt.schema.check_state`). The RNG is None when restored at another
    world size (re-derived), but checked all the same: verify and restore agree."""
    where = os.path.join(d, m.ranks[rank])
    try:
        blob = load_json(raw, budget, where)
        tree = blob["state"]
        rng = codec.decode(blob["rng"])
        refs = _Refs(m.tensors)
        sd = codec.decode(tree, refs)  # every reference resolves
        check_state(
            sd,
            rng,
            refs=refs.seen,
            stored=[k for k, t in m.tensors.items() if t.rank in (None, rank)],
            components=m.extra.get("components"),
            layouts=m.extra.get("layouts"),
            generators=m.extra.get("generators"),
            counters=m.counters if rank == 0 else None,
            where=where,
        )
    except TooCostly:
        raise
    except (KeyError, TypeError, ValueError, RecursionError, SchemaError) as e:
        first = (str(e).splitlines() or [""])[0]  # torch appends its C++ stack
        detail = first if isinstance(e, SchemaError) else f"{where}: {type(e).__name__}: {first}"
        raise CorruptCheckpoint(step, "bad-state", detail) from e
    return tree, rng if m.world_size == world else None, frozenset(refs.seen)


def read_checkpoint(root: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """Verify and decode one checkpoint (default: the newest) without a TrainState.
    Returns the state dict as saved: ``counters``, ``components`` and ``rng``; tensors of a
    sharded checkpoint are assembled whole."""
    from unbroken.ckpt.tensor_io import fill

    store = Store(path_str(root))
    steps = store.steps()
    if not steps:
        raise ValueError(f"{root!r} holds no committed checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(
            f"no committed checkpoint for step {step} in {root!r}; committed steps: {steps}"
        )
    v = load_verified(store, step)
    if not v.sharded:
        return v.decode()
    whole = {k: torch.empty(t.shape, dtype=t.torch_dtype) for k, t in v.manifest.tensors.items()}
    fill(store.step_dir(step), v.manifest, whole)
    return v.decode(whole)


def _desc(shape: Any, dtype: Any) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def check_fits(
    v: Verified, live: Mapping[str, torch.Tensor], components: Mapping[str, Any]
) -> list[str]:
    """Every way the verified checkpoint ``v`` does not fit the live state: ``live`` is the
    live state's tensors by checkpoint key, ``components`` the live objects by name. Empty
    when it fits. Checked before the first tensor is copied, so a mismatch leaves the live
    state untouched (torch's ``load_state_dict`` copies the tensors that match before it
    reports the ones that do not)."""
    problems: list[str] = []
    saved = v.tree.get("components") if isinstance(v.tree, dict) else None
    saved_names = set(saved) if isinstance(saved, dict) else set()
    missing = sorted(set(components) - saved_names)
    extra = sorted(saved_names - set(components))
    if missing or extra:
        problems.append(
            f"components missing from the checkpoint {missing}, present only in the "
            f"checkpoint {extra} (construct TrainState with the components the run that saved "
            "it had)"
        )

    def strict(key: str) -> bool:  # modules load strictly: every key on both sides
        return isinstance(components.get(component_of(key)), torch.nn.Module)

    def exact(key: str) -> bool:  # torch's loaders: the live shapes (a plain Stateful decides)
        return isinstance(components.get(component_of(key)), _TENSOR_LOADERS)

    for k in sorted(v.needed):
        t = v.manifest.tensors[k]
        dst = live.get(k)
        if dst is None:
            if t.sharded:
                problems.append(
                    f"{k}: sharded {_desc(t.shape, t.dtype)} in the checkpoint, no tensor in the "
                    "live state (create it before restore; for optimizers: torch.distributed."
                    "checkpoint.state_dict.get_optimizer_state_dict)"
                )
            elif strict(k):
                problems.append(f"{k}: {_desc(t.shape, t.dtype)} in the checkpoint, not live")
        elif (tuple(dst.shape) != t.shape or dst.dtype != t.torch_dtype) and (
            t.sharded or exact(k)
        ):
            problems.append(
                f"{k}: {_desc(t.shape, t.dtype)} in the checkpoint, "
                f"{_desc(dst.shape, dst.dtype)} live"
            )
    for k, dst in live.items():
        if k not in v.needed and strict(k):
            problems.append(f"{k}: {_desc(dst.shape, dst.dtype)} live, not in the checkpoint")
    for name, obj in components.items():
        if isinstance(obj, torch.optim.Optimizer) and isinstance(saved, dict):
            groups = (
                saved.get(name, {}).get("param_groups")
                if isinstance(saved.get(name), dict)
                else None
            )
            have = [len(g["params"]) for g in obj.param_groups]
            got = (
                [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
                if isinstance(groups, list)
                else None
            )
            if got != have:
                problems.append(
                    f"components/{name}: parameter groups of sizes {got} in the checkpoint, "
                    f"{have} live"
                )
    return problems
