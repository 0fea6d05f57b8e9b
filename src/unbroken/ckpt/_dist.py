"""The checkpoint's collectives: over a dedicated gloo group, or no-ops for one process."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Comm", "is_dist"]

T = TypeVar("T")


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


class Comm:
    """Collectives of one checkpointer.

    ``collective=True`` (the default in an initialised job) uses its own gloo group, so a
    background save never interleaves with the training loop's collectives;
    ``collective=False`` makes this process save and restore alone (e.g. rank 0 of a DDP job
    writing replicated state by itself).
    """

    def __init__(self, collective: bool | None = None) -> None:
        self.enabled = is_dist() if collective is None else collective
        if self.enabled and not is_dist():
            raise ValueError(
                "distributed=True but torch.distributed is not initialised; call "
                "init_process_group first or pass distributed=False"
            )
        self.group: Any = dist.new_group(backend="gloo") if self.enabled else None
        # The loop's per-step decisions (save now? preempted?) get a group of their own: a
        # background save's collectives run on ``group`` from another thread, and two
        # threads issuing collectives on one group can pair up different calls across ranks.
        self.control: Any = dist.new_group(backend="gloo") if self.enabled else None

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.enabled else 0

    @property
    def world(self) -> int:
        return dist.get_world_size() if self.enabled else 1

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, on every rank (collective decisions need all of them)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def any_of(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag OR-ed over all ranks (one small all-reduce on the control group)."""
        if not self.enabled:
            return tuple(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return tuple(bool(v) for v in t.tolist())

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)
