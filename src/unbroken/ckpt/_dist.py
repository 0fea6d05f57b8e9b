"""Thin helpers over ``torch.distributed`` that degrade to single-process no-ops."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["agree_all", "barrier", "broadcast", "gather", "is_dist", "rank", "world"]

T = TypeVar("T")


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world() -> int:
    return dist.get_world_size() if is_dist() else 1


def broadcast(obj: T, src: int = 0, group: Any = None) -> T:
    """Rank ``src``'s ``obj`` on every rank (``src`` is a rank of the default group)."""
    if not is_dist():
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather(obj: T, group: Any = None) -> list[T]:
    """All ranks' ``obj`` (every rank gets the list: needed for collective decisions)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree_all(ok: bool, group: Any = None) -> bool:
    """True only if ``ok`` on every rank."""
    if not is_dist():
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def barrier(group: Any = None) -> None:
    if is_dist():
        dist.barrier(group=group)
