"""State fingerprints for ``unbroken drill``: what each rank held when it saved a checkpoint,
right after it restored one, and one step later.

Off unless ``UNBROKEN_STATE_AUDIT=<dir>`` is set (the drill sets it for the runs it starts);
then :class:`unbroken.ckpt.Checkpointer` calls :meth:`StateAudit.saved` at each snapshot,
:meth:`StateAudit.restored` after each restore and :meth:`StateAudit.step` at each
``maybe_save()``. With the variable unset every call is a no-op. :func:`read_audit` reads
the records back.

Comparing ``restored`` with the same rank's ``saved`` finds state that a restore did not
bring back; comparing ``step`` records of two runs finds state that was changed after the
restore (:mod:`unbroken.elastic.drill.judge`). Cost: every tensor of the state is hashed
(copied to the CPU first) at each save and once after each restore: fine for a drill, not
meant for production runs.

The record format: ARCHITECTURE.md, "Design notes" > common > the state audit.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import xxhash

from unbroken.common.fs import open_private, private_dir

__all__ = ["ENV_AUDIT", "StateAudit", "fingerprint", "read_audit", "state_audit"]

ENV_AUDIT = "UNBROKEN_STATE_AUDIT"


_SCALARS = (int, float, str, bool, type(None))


def _leaves(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}/{k}" if path else str(k))
    elif isinstance(obj, list | tuple) and not all(isinstance(v, _SCALARS) for v in obj):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}/{i}")
    else:  # a list of plain values (python's RNG state, param ids) is one leaf
        yield path, obj


def _digest(v: Any) -> str:
    """``<kind>:<xxh3-64>``; kind ``f``: a float tensor of several values (what a training
    step computes), ``s``: one float (a scale, a learning rate, Adam's step), ``d``: anything
    discrete (integers, positions, RNG states, strings)."""
    import torch

    if isinstance(v, torch.Tensor):
        t = v.detach()
        if hasattr(t, "to_local"):  # DTensor: this rank's shard
            t = t.to_local()
        t = t.cpu().contiguous()
        kind = ("f" if t.numel() > 1 else "s") if t.is_floating_point() or t.is_complex() else "d"
        head = f"{t.dtype}{tuple(t.shape)}".encode()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{kind}:{xxhash.xxh3_64_hexdigest(head + raw)}"
    if isinstance(v, np.ndarray):
        kind = "f" if v.dtype.kind in "fc" and v.size > 1 else "d"
        return f"{kind}:{xxhash.xxh3_64_hexdigest(f'{v.dtype}{v.shape}'.encode() + v.tobytes())}"
    if isinstance(v, bytes | bytearray):
        return f"d:{xxhash.xxh3_64_hexdigest(bytes(v))}"
    kind = "s" if isinstance(v, float) else "d"
    return f"{kind}:{xxhash.xxh3_64_hexdigest(repr(v).encode())}"  # a float's repr is exact


def fingerprint(sd: Mapping[str, Any], rng: Any = None) -> dict[str, str]:
    """``{leaf: hash}`` of a ``TrainState.state_dict()`` (``rng`` given apart or inside)."""
    out: dict[str, str] = {}
    for part, value in sd.items():
        prefix = "" if part == "components" else part
        for k, v in _leaves(value, prefix):
            out[k] = _digest(v)
    if rng is not None:
        for k, v in _leaves(rng, "rng"):
            out[k] = _digest(v)
    return out


class StateAudit:
    """Writes the records of one rank (module docstring). ``comm`` has ``rank``/``world``."""

    def __init__(self, root: str, state: Any, comm: Any) -> None:
        self.root = root
        self.state = state
        self.comm = comm
        self._armed: int | None = None  # the step saved or restored last; None: not armed

    def _write(self, event: str, step: int, leaves: dict[str, str]) -> None:
        rank, world = int(self.comm.rank), int(self.comm.world)
        rec = {
            "event": event,
            "step": int(step),
            "rank": rank,
            "world": world,
            "pid": os.getpid(),
            "t": round(time.time(), 4),
            "leaves": leaves,
        }
        private_dir(self.root, purpose="state audit directory")
        # one write of one line in append mode: records of successive attempts never mix
        path = os.path.join(self.root, f"rank-{rank}.jsonl")
        fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)

    def saved(self, step: int, sd: Mapping[str, Any], rng: Any) -> None:
        self._write("saved", step, fingerprint(sd, rng))
        self._armed = step

    def restored(self, step: int) -> None:
        self._write("restored", step, fingerprint(self.state.state_dict()))
        self._armed = step

    def step(self, step: int) -> None:
        if self._armed is None or step <= self._armed:
            return
        if step == self._armed + 1:
            self._write("step", step, fingerprint(self.state.state_dict()))
        self._armed = None


class _Off:
    def saved(self, step: int, sd: Mapping[str, Any], rng: Any) -> None:
        pass

    def restored(self, step: int) -> None:
        pass

    def step(self, step: int) -> None:
        pass


def state_audit(state: Any, comm: Any) -> StateAudit | _Off:
    """A :class:`StateAudit` when ``UNBROKEN_STATE_AUDIT`` is set, else a no-op."""
    root = os.environ.get(ENV_AUDIT)
    return StateAudit(root, state, comm) if root else _Off()


def read_audit(root: str) -> dict[int, list[dict[str, Any]]]:
    """``{rank: records in file order}``; torn or damaged lines (a record without an
    integer rank and step, or leaves) are skipped, and so is a name that is not a regular
    file (never read through a symlink, never blocking on a FIFO)."""
    out: dict[int, list[dict[str, Any]]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in sorted(names):
        if not (name.startswith("rank-") and name.endswith(".jsonl")):
            continue
        try:
            fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with open(fd, encoding="utf-8", errors="replace") as f:
            lines = f.readlines() if stat.S_ISREG(os.fstat(fd).st_mode) else []
        recs = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if (
                isinstance(rec, dict)
                and isinstance(rec.get("leaves"), dict)
                and all(type(rec.get(k)) is int for k in ("rank", "step"))
            ):
                recs.append(rec)
        if recs:
            out[recs[0]["rank"]] = recs
    return out
