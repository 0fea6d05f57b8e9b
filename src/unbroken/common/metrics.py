"""A resumable, rank-aware metric log: JSONL on disk, TensorBoard mirror when installed.

Each line is ``{"step": N, "time": unix, <name>: value, ...}``. The log's ``state_dict`` is
the last step it logged; restoring it drops every line past that step (the run is about to
log those steps again), and a run that starts fresh (``Checkpointer.restore()`` found no
checkpoint and calls :meth:`MetricLog.start_fresh`) drops the lines an earlier attempt
wrote before its first checkpoint. A plot of the log shows one curve, never a repeated
segment (E-MEASURED). TensorBoard gets the same effect through ``purge_step``.

Multi-rank jobs: create the same ``MetricLog`` on every rank and call ``log`` on every rank;
only rank 0 writes (the other ranks keep the step, so every rank's checkpointed state is the
same). ``all_ranks=True`` with ``{rank}`` in the path gives each rank its own file instead.
:func:`global_ids` gathers each rank's sample ids of a step into the order a one-rank run
consumes them (what ``unbroken drill`` compares).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from typing import IO, Any

from unbroken.common.fs import atomic_write_bytes

__all__ = ["MetricLog", "global_ids", "read_metrics"]

log = logging.getLogger(__name__)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All complete records of a metric log. A torn last line (a crash mid-write) is skipped;
    so is a damaged line (not JSON, no integer ``step``), with one WARNING naming the file."""
    out = []
    bad = 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.endswith("\n"):
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    bad += 1
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                    out.append(rec)
                else:
                    bad += 1
    except FileNotFoundError:
        return []
    if bad:
        log.warning("metric log %s: skipped %d damaged line(s)", path, bad)
    return out


def _dist_rank() -> tuple[int, int]:
    """(rank, world size) from an initialized process group, else torchrun's environment."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class MetricLog:
    """Append-only JSONL metrics with resume semantics.

    Args:
        path: the ``.jsonl`` file (created with its directory). With ``all_ranks=True`` it
            must contain ``{rank}`` (replaced by the rank) when the job has several ranks.
        tensorboard_dir: also mirror scalars to TensorBoard here, when installed.
        rank: this process's rank (default: from ``torch.distributed`` when initialized,
            else the ``RANK`` variable torchrun sets, else 0).
        all_ranks: every rank writes its own file (default: rank 0 writes, the others only
            count steps).
    """

    def __init__(
        self,
        path: str,
        *,
        tensorboard_dir: str | None = None,
        rank: int | None = None,
        all_ranks: bool = False,
    ) -> None:
        env_rank, world = _dist_rank()
        self.rank = env_rank if rank is None else int(rank)
        if all_ranks:
            if "{rank}" not in path and world > 1:
                raise ValueError(
                    f"MetricLog({path!r}, all_ranks=True) on {world} ranks: every rank would "
                    "write the same file; put {rank} in the path, e.g. 'run/metrics-{rank}.jsonl'"
                )
            path = path.replace("{rank}", str(self.rank))
        self.path = path
        self.writes = all_ranks or self.rank == 0
        """Whether this process writes the file (rank 0, or every rank with all_ranks)."""
        self.step = -1
        self._tb_dir = tensorboard_dir if self.writes else None
        self._tb: Any = None
        if self.writes:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._f: IO[str] | None = None
        self._open_tb(purge_step=None)

    def _open_tb(self, purge_step: int | None) -> None:
        if self._tb_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard is not installed; metrics go to %s only", self.path)
            self._tb_dir = None
            return
        if self._tb is not None:
            self._tb.close()
        self._tb = SummaryWriter(self._tb_dir, purge_step=purge_step)

    def log(self, step: int, **values: Any) -> None:
        """Record JSON-serialisable ``values`` at ``step`` (steps must not go backwards).

        Call it on every rank; only the writing rank touches the file. Numbers are mirrored
        to TensorBoard; other values (lists, strings) only go to JSONL.
        """
        if step < self.step:
            raise ValueError(
                f"metric step {step} is before the last logged step {self.step}; log steps in "
                "order (after a restore, the log resumes from the restored step)"
            )
        self.step = step
        if not self.writes:
            return
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        rec = {"step": step, "time": round(time.time(), 3), **values}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, int | float):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def _keep(self, keep: int, why: str) -> None:
        """Rewrite the file with only the records at steps ``<= keep``."""
        self.close()
        if not self.writes:
            return
        records = read_metrics(self.path)
        kept = [r for r in records if r["step"] <= keep]
        if len(kept) != len(records) or os.path.exists(self.path):
            body = "".join(json.dumps(r) + "\n" for r in kept)
            atomic_write_bytes(self.path, body.encode())
            if len(kept) != len(records):
                log.info(
                    "metric log %s: dropped %d entries %s", self.path, len(records) - len(kept), why
                )
        self._open_tb(purge_step=keep + 1)

    # --- Stateful ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume at ``sd["step"]``: lines logged after it (before a crash) are dropped."""
        step = int(sd["step"])
        self._keep(step, f"past restored step {step}")
        self.step = step

    def start_fresh(self) -> None:
        """The run starts from scratch (no checkpoint was restored): drop every line an
        earlier attempt logged, e.g. before it was killed ahead of its first checkpoint.
        ``Checkpointer.restore()`` calls this when it finds nothing to restore."""
        self._keep(-1, "of an earlier attempt (no checkpoint restored: a fresh start)")
        self.step = -1


def global_ids(ids: Iterable[Any]) -> list[int]:
    """This step's sample ids of every rank, in the order a one-rank run consumes them.

    A collective: call it on every rank (a no-op without a process group). Rank ``r`` of
    ``W`` holds positions ``r, r + W, r + 2W, ...`` of the global batch
    (:class:`unbroken.data.StreamingDataset`), so the ranks' lists are interleaved.
    ``ids``: a tensor or list of ints (e.g. ``batch["__id__"]`` with ``with_ids=True``).
    """
    import torch

    mine = torch.as_tensor(ids).reshape(-1).tolist() if not isinstance(ids, list) else list(ids)
    mine = [int(i) for i in mine]
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return mine
    except ImportError:  # pragma: no cover
        return mine
    # Tensors, not all_gather_object: a peer's pickle would run whatever it names, and
    # whoever reaches the job's store can pose as a peer.
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=on) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64, device=on))
    counts = [int(n) for n in sizes]
    if not any(counts):
        return []
    padded = torch.zeros(max(counts), dtype=torch.int64, device=on)
    padded[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return _interleave([p[:n].tolist() for p, n in zip(parts, counts, strict=True)])


def _interleave(parts: list[list[int]]) -> list[int]:
    """``[[a0, a1], [b0, b1]]`` -> ``[a0, b0, a1, b1]`` (a shorter last batch just ends)."""
    out: list[int] = []
    for k in range(max((len(p) for p in parts), default=0)):
        out += [p[k] for p in parts if k < len(p)]
    return out
