"""Reading a checkpoint back: full verification before anything is applied (C-VERIFIED).

Checks, in order: the manifest parses and matches its directory; every listed file exists
with its recorded size; every data file's xxh3 checksum (over a read-only mapping of the
page cache); the rank state file and DCP metadata checksums; every unsharded tensor's
sum/norm against the statistics recorded at save time. Any failure raises
:class:`CorruptCheckpoint` with a short reason slug used for quarantine names.

In a multi-rank job each rank verifies what it needs: replicated tensors are read (and so
verified) by every rank; for sharded checkpoints rank ``r`` verifies data files
``r, r+W, ...`` and the ranks then agree (see ``Checkpointer.restore``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unbroken._fs import checksum_bytes, checksum_file
from unbroken.ckpt import codec
from unbroken.ckpt.saver import ChecksumError, ItemLocation, read_tensors, stats_match
from unbroken.ckpt.store import CorruptCheckpoint, Store

__all__ = ["Verified", "into_live", "load_verified", "read_checkpoint"]


@dataclass(frozen=True)
class Verified:
    """A fully verified checkpoint, not yet applied.

    ``tensors`` are read-only zero-copy views (see :func:`read_tensors`); empty when the
    checkpoint is sharded (it then loads through DCP into live DTensors). ``rng`` is None
    when the checkpoint was saved with another world size (per-rank streams are re-derived).
    """

    step: int
    manifest: dict[str, Any]
    tree: Any
    tensors: dict[str, torch.Tensor]
    rng: Any

    @property
    def sharded(self) -> bool:
        return any(t.get("sharded") for t in self.manifest["tensors"].values())

    def decode(self, tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """The state dict; with no ``tensors`` given, owned copies of every tensor."""
        if tensors is None:
            tensors = {k: v.clone() for k, v in self.tensors.items()}
        sd = codec.decode(self.tree, tensors)
        if self.rng is not None:
            sd["rng"] = self.rng
        return sd


def _locations(m: Mapping[str, Any]) -> list[ItemLocation]:
    return [
        ItemLocation(k, tuple(c["offsets"]), c["file"], c["offset"], c["length"])
        for k, t in m["tensors"].items()
        for c in t["chunks"]
    ]


def load_verified(store: Store, step: int, *, rank: int = 0, world: int = 1) -> Verified:
    """Read and fully verify ``step`` for ``rank`` of ``world``."""
    m = store.read_manifest(step)
    d = store.step_dir(step)
    files: dict[str, Any] = m["files"]
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, f in files.items():
            p = os.path.join(d, name)
            if not os.path.isfile(p):
                raise CorruptCheckpoint(step, "missing-file", f"{p} is missing")
            if os.path.getsize(p) != f["size"]:
                raise CorruptCheckpoint(
                    step, "size", f"{p} has {os.path.getsize(p)} bytes, manifest says {f['size']}"
                )
        locs = _locations(m)
        data_names = sorted({loc.file for loc in locs})
        if any(t.get("sharded") for t in m["tensors"].values()):
            for i, name in enumerate(data_names):  # split the verification across ranks
                if (
                    i % world == rank
                    and checksum_file(os.path.join(d, name))[1] != files[name]["checksum"]
                ):
                    raise ChecksumError(os.path.join(d, name), "checksum mismatch")
        else:
            tensors = read_tensors(d, {n: files[n] for n in data_names}, locs, m["tensors"])
        saved_world = int(m["world_size"])
        rank_file = m["ranks"][str(rank if rank < saved_world else 0)]["state"]
        p = os.path.join(d, rank_file)
        with open(p, "rb") as fh:
            raw = fh.read()
        if checksum_bytes(raw) != files[rank_file]["checksum"]:
            raise CorruptCheckpoint(step, "checksum", f"{p}: checksum mismatch")
        md = os.path.join(d, ".metadata")
        if checksum_file(md)[1] != files[".metadata"]["checksum"]:
            raise CorruptCheckpoint(step, "checksum", f"{md}: checksum mismatch")
    except ChecksumError as e:
        raise CorruptCheckpoint(step, "checksum", str(e)) from e
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(step, "bad-manifest", f"{d}: {e!r}") from e
    for k, t in tensors.items():
        if not stats_match(m["tensors"][k].get("stats"), t):
            raise CorruptCheckpoint(
                step, "stats", f"tensor {k!r} in {d} does not match its recorded sum/norm"
            )
    try:
        blob = json.loads(raw)
        rng = codec.decode(blob["rng"]) if saved_world == world else None
        return Verified(step, m, blob["state"], tensors, rng)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(step, "bad-state", f"{p}: {e!r}") from e


def read_checkpoint(root: str, step: int | None = None) -> dict[str, Any]:
    """Verify and decode one unsharded checkpoint (default: the newest) without a
    TrainState. Returns the state dict as saved: ``counters``, ``components`` and ``rng``.
    """
    store = Store(root)
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
    if v.sharded:
        raise ValueError(
            f"checkpoint step {step} in {root!r} holds sharded tensors; load it with "
            "Checkpointer.restore() inside the distributed job"
        )
    return v.decode()


def into_live(
    views: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Copy verified views into the live tensors of matching key, shape and dtype (memory
    that is already paged in); clone the rest."""
    out = {}
    for k, v in views.items():
        dst = live.get(k)
        if dst is not None and dst.shape == v.shape and dst.dtype == v.dtype:
            with torch.no_grad():
                dst.copy_(v)
            out[k] = dst
        else:
            out[k] = v.clone()
    return out
