"""``Checkpointer``: save, verify, restore with fall-back, and retention over a root dir.

Typical loop::

    ckpt = Checkpointer("ckpts", state, every_steps=100, keep_last=3)
    start = ckpt.restore() or 0          # newest checkpoint that verifies, else None
    for step in range(start, total):
        train_one_step(); state.step = step + 1
        ckpt.maybe_save()                # at optimizer-step boundaries only

Verification on restore (C-VERIFIED): manifest parses and matches its directory, every
file exists with the recorded size and checksum, every tensor's sum/norm matches the
recorded statistics. A checkpoint failing any check is renamed
``corrupt-step-N-<reason>`` with one WARNING line, and the next older one is tried; the
live training objects are touched only once a checkpoint has fully verified.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import unbroken
from unbroken._fs import atomic_write_bytes, checksum_bytes, checksum_file
from unbroken.ckpt import codec
from unbroken.ckpt.saver import (
    ChecksumError,
    ItemLocation,
    read_tensors,
    stats_match,
    write_tensors,
)
from unbroken.ckpt.state import TrainState
from unbroken.ckpt.store import FORMAT, FORMAT_VERSION, CheckpointInfo, CorruptCheckpoint, Store

__all__ = ["Checkpointer", "Verified", "load_verified", "read_checkpoint"]

log = logging.getLogger(__name__)


def _mark_loaded(step: int, seconds: float) -> None:
    try:
        from unbroken.elastic import recovery  # type: ignore[attr-defined]
    except ImportError:  # the supervisor package is optional at this layer
        return
    mark = getattr(recovery, "mark", None)
    if mark is not None:
        mark("loaded", step=step, seconds=seconds)


class Checkpointer:
    """Crash-proof checkpoints of a :class:`TrainState` under ``root``.

    Args:
        root: checkpoint directory (local or shared filesystem path).
        state: the :class:`TrainState` to save and restore.
        every_steps: :meth:`maybe_save` saves when ``step % every_steps == 0``.
        every_seconds: ... or when this many seconds passed since the last save.
        keep_last: committed checkpoints to keep (older ones are deleted after each commit;
            ``None`` keeps all). Default 3: the newest plus two fall-backs.
        keep_every: additionally keep every step divisible by this forever.
        allow_fresh_start: when the root holds files but no valid checkpoint, start from
            scratch instead of raising (default False: never silently restart a run).
        io_threads: parallel writer threads (DCP ``thread_count``).
    """

    def __init__(
        self,
        root: str,
        state: TrainState,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        allow_fresh_start: bool = False,
        io_threads: int = 2,
    ) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"state must be an unbroken.ckpt.TrainState, got {type(state).__qualname__}"
            )
        for name, v in (
            ("every_steps", every_steps),
            ("keep_last", keep_last),
            ("keep_every", keep_every),
        ):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r} must be a positive integer or None")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError(f"every_seconds={every_seconds!r} must be > 0 or None")
        if io_threads < 1:
            raise ValueError(f"io_threads={io_threads!r} must be >= 1")
        self.store = Store(root)
        self.state = state
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.allow_fresh_start = allow_fresh_start
        self.io_threads = io_threads
        self._last_save_time = time.monotonic()
        self.last_save_seconds: float | None = None
        self.last_restore_seconds: float | None = None

    # --- queries ----------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first (not verified: see :meth:`verify`)."""
        return [self.store.info(s) for s in self.store.steps()]

    def latest(self) -> int | None:
        steps = self.store.steps()
        return steps[-1] if steps else None

    def _require_step(self, step: int) -> None:
        if step not in self.store.steps():
            raise ValueError(
                f"no committed checkpoint for step {step} in {self.store.root!r}; committed "
                f"steps: {self.store.steps() or 'none'}"
            )

    def verify(self, step: int) -> None:
        """Fully verify one checkpoint; raises :class:`CorruptCheckpoint` on damage."""
        self._require_step(step)
        load_verified(self.store, step)

    # --- save -------------------------------------------------------------------------------

    def maybe_save(self, step: int | None = None) -> bool:
        """Save if ``every_steps``/``every_seconds`` says so; returns whether it saved."""
        step = self.state.step if step is None else step
        due = bool(self.every_steps and step % self.every_steps == 0)
        if self.every_seconds is not None:
            due = due or time.monotonic() - self._last_save_time >= self.every_seconds
        if due and step not in self.store.steps():
            self.save(step)
            return True
        return False

    def save(self, step: int | None = None) -> str:
        """Save the complete training state as ``step`` (default ``state.step``) and commit it."""
        step = self.state.step if step is None else step
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        self.state.check_saveable()
        if os.path.exists(self.store.step_dir(step)):
            raise FileExistsError(
                f"checkpoint for step {step} already exists at {self.store.step_dir(step)}; "
                "steps are immutable once committed"
            )
        return self._save(step)

    def _save(self, step: int) -> str:
        t0 = time.perf_counter()
        sd = self.state.state_dict()
        rng = sd.pop("rng", None)
        tensors: dict[str, torch.Tensor] = {}
        tree = codec.encode(sd, tensors)
        rank_state = json.dumps({"state": tree, "rng": codec.encode(rng, None)}).encode()
        tmp = self.store.begin(step)
        try:
            files, locations, meta = write_tensors(tmp, tensors, threads=self.io_threads)
            digest = atomic_write_bytes(os.path.join(tmp, "state-rank0.json"), rank_state)
            files = {k: v for k, v in files.items() if not k.endswith(".tmp")}
            files["state-rank0.json"] = (len(rank_state), digest)
            files[".metadata"] = checksum_file(os.path.join(tmp, ".metadata"))
            manifest = self._manifest(step, files, locations, meta, sd, time.perf_counter() - t0)
            path = self.store.commit(tmp, step, manifest)
        except OSError as e:
            self.store.abort(tmp)
            if e.errno == errno.ENOSPC:
                raise RuntimeError(
                    f"disk full while writing checkpoint step {step} under {self.store.root!r}; "
                    "the previous checkpoints are intact. Free space, or lower keep_last"
                ) from e
            raise
        except BaseException:
            self.store.abort(tmp)
            raise
        dt = time.perf_counter() - t0
        self._last_save_time = time.monotonic()
        self.last_save_seconds = dt
        total = sum(s for s, _ in files.values())
        log.info(
            "saved step %d to %s: %.1f MB in %.2f s (%.2f GB/s)",
            step,
            path,
            total / 1e6,
            dt,
            total / dt / 1e9,
        )
        gone = self.store.prune(self.keep_last, self.keep_every, protect=[step])
        if gone:
            log.info("retention removed steps %s", gone)
        return path

    def _manifest(
        self,
        step: int,
        files: Mapping[str, tuple[int, str]],
        locations: Sequence[ItemLocation],
        meta: Mapping[str, Any],
        sd: Mapping[str, Any],
        seconds: float,
    ) -> dict[str, Any]:
        tensors = {k: dict(v) for k, v in meta.items()}
        for loc in locations:
            tensors[loc.key].setdefault("chunks", []).append(
                {
                    "offsets": list(loc.chunk_offsets),
                    "file": loc.file,
                    "offset": loc.offset,
                    "length": loc.length,
                }
            )
        loader = sd["components"].get("loader")
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "created": time.time(),
            "world_size": 1,
            "ranks": {"0": {"state": "state-rank0.json"}},
            "unbroken_version": unbroken.__version__,
            "torch_version": torch.__version__,
            "checksum_algo": "xxh3_128",
            "files": {k: {"size": s, "checksum": c} for k, (s, c) in sorted(files.items())},
            "tensors": tensors,
            "counters": dict(sd["counters"]),
            "data_state": loader if _jsonable(loader) else None,
            "save_seconds": round(seconds, 4),
        }

    # --- restore ----------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> int | None:
        """Restore the newest checkpoint that verifies (or exactly ``step``).

        Returns the restored step, or None when the root holds nothing at all. Damaged
        checkpoints are quarantined and the next older one is tried. A root that holds
        files but no valid checkpoint raises, unless ``allow_fresh_start=True``.
        """
        if step is not None:
            self._require_step(step)
        self.store.remove_debris()
        for name in self.store.uncommitted():
            log.warning(
                "ignoring %s/%s: a step directory without manifest.json", self.store.root, name
            )
        candidates = [step] if step is not None else sorted(self.store.steps(), reverse=True)
        t0 = time.perf_counter()
        for s in candidates:
            try:
                ver = load_verified(self.store, s)
            except CorruptCheckpoint as e:
                where = self.store.quarantine(s, e.reason)
                log.warning(
                    "checkpoint step %d is damaged (%s: %s); moved to %s, trying an older one",
                    s,
                    e.reason,
                    e.detail,
                    where,
                )
                if step is not None:
                    raise
                continue
            self.state.check_compatible(ver.decode(ver.tensors))
            live: dict[str, torch.Tensor] = {}
            current = self.state.state_dict()
            current.pop("rng", None)
            codec.encode(current, live)
            self.state.load_state_dict(ver.decode(_into_live(ver.tensors, live)))
            dt = time.perf_counter() - t0
            self.last_restore_seconds = dt
            self._last_save_time = time.monotonic()
            log.info("restored step %d from %s in %.2f s", s, self.store.step_dir(s), dt)
            _mark_loaded(s, dt)
            return s
        if self.store.has_foreign_content() and not self.allow_fresh_start:
            raise RuntimeError(
                f"{self.store.root!r} is not empty but holds no valid checkpoint (damaged ones "
                "were moved to corrupt-step-*); refusing to silently start from scratch. Pass "
                "allow_fresh_start=True to start anew, or point at another directory"
            )
        return None


@dataclass(frozen=True)
class Verified:
    """A fully verified checkpoint, not yet applied: the encoded state tree, read-only
    zero-copy tensor views (see :func:`read_tensors`) and the decoded RNG state."""

    step: int
    tree: Any
    tensors: dict[str, torch.Tensor]
    rng: Any

    def decode(self, tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """The state dict; with no ``tensors`` given, owned copies of every tensor."""
        if tensors is None:
            tensors = {k: v.clone() for k, v in self.tensors.items()}
        sd = codec.decode(self.tree, tensors)
        sd["rng"] = self.rng
        return sd


def load_verified(store: Store, step: int) -> Verified:
    """Read and fully verify ``step`` (files, sizes, checksums, tensor statistics)."""
    m = store.read_manifest(step)
    d = store.step_dir(step)
    files: dict[str, Any] = m["files"]
    try:
        for name, f in files.items():
            p = os.path.join(d, name)
            if not os.path.isfile(p):
                raise CorruptCheckpoint(step, "missing-file", f"{p} is missing")
            if os.path.getsize(p) != f["size"]:
                raise CorruptCheckpoint(
                    step, "size", f"{p} has {os.path.getsize(p)} bytes, manifest says {f['size']}"
                )
        locs = [
            ItemLocation(k, tuple(c["offsets"]), c["file"], c["offset"], c["length"])
            for k, t in m["tensors"].items()
            for c in t["chunks"]
        ]
        data_files = {n: files[n] for n in {loc.file for loc in locs}}
        tensors = read_tensors(d, data_files, locs, m["tensors"])
        rank_file = m["ranks"]["0"]["state"]
        p = os.path.join(d, rank_file)
        with open(p, "rb") as fh:
            raw = fh.read()
        if checksum_bytes(raw) != files[rank_file]["checksum"]:
            raise CorruptCheckpoint(step, "checksum", f"{p}: checksum mismatch")
        md = os.path.join(d, ".metadata")
        if checksum_file(md)[1] != files[".metadata"]["checksum"]:
            raise CorruptCheckpoint(step, "checksum", f"{md}: checksum mismatch")
    except ChecksumError as e:
        reason = "truncated" if "truncated" in e.reason else "checksum"
        raise CorruptCheckpoint(step, reason, str(e)) from e
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(step, "bad-manifest", f"{d}: {e!r}") from e
    for k, t in tensors.items():
        if not stats_match(m["tensors"][k].get("stats"), t):
            raise CorruptCheckpoint(
                step, "stats", f"tensor {k!r} in {d} does not match its recorded sum/norm"
            )
    try:
        blob = json.loads(raw)
        return Verified(step, blob["state"], tensors, codec.decode(blob["rng"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(step, "bad-state", f"{p}: {e!r}") from e


def read_checkpoint(root: str, step: int | None = None) -> dict[str, Any]:
    """Verify and decode one checkpoint (default: the newest) without a TrainState.

    Returns the state dict as saved: ``counters``, ``components`` and ``rng``.
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
    return load_verified(store, step).decode()


def _into_live(
    views: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Copy verified views into the live tensors of matching key, shape and dtype (memory
    that is already paged in); clone the rest."""
    out = {}
    for k, v in views.items():
        dst = live.get(k)
        if (
            dst is not None
            and dst.shape == v.shape
            and dst.dtype == v.dtype
            and dst.device.type == "cpu"
        ):
            with torch.no_grad():
                dst.copy_(v)
            out[k] = dst
        else:
            out[k] = v.clone()
    return out


def _jsonable(obj: Any) -> bool:
    try:
        json.dumps(obj)
    except (TypeError, ValueError):
        return False
    return True
