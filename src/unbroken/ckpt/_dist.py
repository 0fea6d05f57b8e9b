"""The checkpoint's collectives: over a dedicated gloo group, or no-ops for one process."""

from __future__ import annotations

from typing import Any, TypeVar

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

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)
