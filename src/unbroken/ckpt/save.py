"""How a checkpoint is written: the snapshot the loop waits for, then the two-phase commit.

:meth:`Saver.snapshot` (the only part the training loop waits for, C-ASYNC): encode the
state (tensors apart, :mod:`.codec`), copy the tensors into reusable host buffers when the
write runs in the background (:mod:`.snapshot`), and open the temporary directory.

:meth:`Saver.commit` (C-ATOMIC, C-PER-RANK), collective:

1. every rank: split off what differs between ranks (:func:`.per_rank.split`), write its
   tensors (DCP layout, checksums computed while writing, :mod:`.tensor_io`) and its state
   file into the temporary directory, and report to rank 0 (error, files, own tensors);
2. rank 0: when every rank succeeded, write ``manifest.json`` last and rename the directory
   into place (:meth:`.store.Store.commit`); otherwise remove it;
3. every rank learns the outcome, and raises the same error when there was one.

Triggers, retention, the archive and the writer lock are the :class:`Checkpointer`'s.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

import unbroken
from unbroken.ckpt import codec, per_rank, schema
from unbroken.ckpt.collectives import Comm
from unbroken.ckpt.manifest import (
    METADATA,
    CheckpointManifest,
    Chunk,
    FileEntry,
    TensorEntry,
    split_key,
)
from unbroken.ckpt.snapshot import Snapshotter
from unbroken.ckpt.state import TrainState
from unbroken.ckpt.store import Store
from unbroken.ckpt.tensor_io import ItemLocation, write_tensors
from unbroken.common.fs import atomic_write_bytes, checksum_file
from unbroken.common.jsonable import plain_json

__all__ = ["Job", "Saver", "encode"]

Files = dict[str, tuple[int, str]]  # name -> (size, checksum)


def encode(state: TrainState) -> tuple[dict[str, Any], Any, Any, dict[str, torch.Tensor]]:
    """(state dict without RNG, RNG state, JSON tree, {key: live tensor})."""
    sd = state.state_dict()
    rng_state = sd.pop("rng", None)
    live: dict[str, torch.Tensor] = {}
    tree = codec.encode(sd, live)
    return sd, rng_state, tree, live


@dataclass
class Job:
    """One save between its snapshot and its commit."""

    step: int
    tmp: str
    tensors: dict[str, torch.Tensor]
    sd: dict[str, Any]
    tree: Any  # the encoded state dict (tensor references), without RNG
    rng: Any  # the encoded RNG state of this rank
    t0: float
    blocked: float = 0.0
    # filled by the write: what differs between ranks, where DCP put each tensor, and the
    # dtype/shape/stats of this rank's tensors
    differing: dict[str, list[str]] = field(default_factory=dict)
    locations: list[ItemLocation] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Report:
    """What one rank tells rank 0 after phase 1."""

    error: str | None
    files: Files
    own: dict[str, Any]  # meta of this rank's own copies (rank 0 lists them all)


class Saver:
    """Writes checkpoints of ``state`` under ``store`` with ``comm``'s ranks."""

    def __init__(
        self,
        store: Store,
        state: TrainState,
        comm: Comm,
        io_threads: int,
        audit: Any,
        direct_io: bool = True,
    ) -> None:
        self.store, self.state, self.comm, self.io_threads = store, state, comm, io_threads
        self.direct_io = direct_io  # data files by O_DIRECT (tensor_io.write_tensors)
        self.audit = audit  # `unbroken drill`'s state fingerprints; a no-op otherwise
        self.warned: set[str] = set()  # components reported as differing between ranks

    def snapshot(self, step: int, buffers: Snapshotter | None, *, disk: bool = True) -> Job:
        """Capture the state as of now: with ``buffers``, copies the background write
        reads (the loop may go on at once); without, the live tensors themselves.
        ``disk=False``: for the memory tier only (no temporary directory, no collective)."""
        t0 = time.perf_counter()
        sd, rng_state, tree, live = encode(self.state)
        self.audit.saved(step, sd, rng_state)
        tensors = buffers.take(live) if buffers is not None else live
        rng_tree = codec.encode(rng_state, None)
        tmp = self.store.begin(step) if disk and self.comm.rank == 0 else ""
        tmp = self.comm.broadcast(tmp) if disk else ""
        return Job(step, tmp, tensors, sd, tree, rng_tree, t0, time.perf_counter() - t0)

    def commit(self, job: Job) -> tuple[str, int]:
        """Write and commit ``job`` on every rank (collective); returns the committed
        directory and the bytes written by all ranks. Raises on any rank's failure, on
        every rank, after removing the temporary directory."""
        err, mine = self._write(job)
        reports = self.comm.gather(mine, allow=(_Report,))
        failed = [(r, rep.error) for r, rep in enumerate(reports) if rep.error]
        if self.comm.rank == 0:
            if failed:
                self.store.abort(job.tmp)
            else:
                try:
                    self.store.commit(job.tmp, job.step, self._manifest(job, reports))
                except BaseException as e:  # noqa: BLE001 - every rank raises it below
                    self.store.abort(job.tmp)
                    failed = [(0, repr(e))]
                    err = err or e
        failed = self.comm.broadcast(failed)
        if failed:
            self._raise(job, failed, err)
        return self.store.step_dir(job.step), sum(s for r in reports for s, _ in r.files.values())

    def _write(self, job: Job) -> tuple[BaseException | None, _Report]:
        """Phase 1 on this rank: tensors and state file into the temporary directory."""
        rank = self.comm.rank
        try:
            tree, tensors, job.differing = per_rank.split(
                job.tree, job.tensors, self.state, self.comm, job.step, self.warned
            )
            files, job.locations, job.meta = write_tensors(
                job.tmp, tensors, threads=self.io_threads, comm=self.comm, direct=self.direct_io
            )
            rank_state = json.dumps({"state": tree, "rng": job.rng}).encode()
            name = f"state-rank{rank}.json"
            files[name] = (
                len(rank_state),
                atomic_write_bytes(os.path.join(job.tmp, name), rank_state),
            )
            own = {k: v for k, v in job.meta.items() if split_key(k)[0] == rank}
            return None, _Report(None, files, own)
        except BaseException as e:  # noqa: BLE001 - reported collectively by commit()
            return e, _Report(repr(e), {}, {})

    def _raise(
        self, job: Job, failed: Sequence[tuple[int, str | None]], err: BaseException | None
    ) -> NoReturn:
        """The same failure on every rank: this rank's own error, else the ranks that failed."""
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            raise RuntimeError(
                f"disk full while writing checkpoint step {job.step} under "
                f"{self.store.root!r}; the previous checkpoints are intact. Free space, "
                "or lower keep_last"
            ) from err
        if err is not None:
            raise err
        raise RuntimeError(
            f"checkpoint step {job.step} failed on rank(s) {list(failed)}; nothing was committed"
        )

    def _manifest(self, job: Job, reports: Sequence[_Report]) -> CheckpointManifest:
        """Rank 0's description of the whole checkpoint, from every rank's report."""
        files = {k: v for r in reports for k, v in r.files.items()}
        files[METADATA] = checksum_file(os.path.join(job.tmp, METADATA))
        meta = dict(job.meta)
        for r, rep in enumerate(reports):
            meta.update({k: {**v, "rank": r} for k, v in rep.own.items()})
        return _describe(job, files, meta, len(reports), self.state)


def _describe(
    job: Job, files: Files, meta: Mapping[str, Any], world: int, state: TrainState
) -> CheckpointManifest:
    chunks: dict[str, list[Chunk]] = {}
    for loc in job.locations:
        chunks.setdefault(loc.key, []).append(
            Chunk(loc.chunk_offsets, loc.chunk_sizes, loc.file, loc.offset, loc.length)
        )
    return CheckpointManifest(
        step=job.step,
        world_size=world,
        ranks={r: f"state-rank{r}.json" for r in range(world)},
        files={k: FileEntry(s, c) for k, (s, c) in files.items()},
        tensors={
            k: TensorEntry(
                v["dtype"],
                tuple(v["shape"]),
                v["sharded"],
                v["stats"],
                tuple(chunks[k]),
                v.get("rank"),  # set for a rank's own copy of state that differed
                v["checksum"],
            )
            for k, v in meta.items()
        },
        counters=dict(job.sd["counters"]),
        # None when the loader's state is not JSON
        data_state=plain_json(job.sd["components"].get("loader")),
        created=time.time(),
        unbroken_version=unbroken.__version__,
        torch_version=torch.__version__,
        save_seconds=round(time.perf_counter() - job.t0, 4),
        blocked_seconds=round(job.blocked, 4),
        extra={
            "components": per_rank.manifest_section(job.differing, state.sharing),
            "layouts": schema.describe(state.components, job.sd["components"]),
            "generators": schema.generators(state),
        },
    )
