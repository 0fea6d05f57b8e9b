"""The checkpoint's collectives: over a dedicated gloo group, or no-ops for one process.

A peer's message is untrusted input: the job's groups are made from a store without
authentication, so whoever reaches it can pose as a rank. Messages travel as pickles in
uint8 tensors (as ``broadcast_object_list`` sends them) but are read back by an unpickler
that resolves no global except builtin exceptions and the classes the call names, within
:data:`MAX_MESSAGE` bytes: a crafted message is refused by rank, never run.
"""

from __future__ import annotations

import atexit
import builtins
import io
import logging
import pickle
from collections.abc import Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["MAX_MESSAGE", "Comm", "is_dist", "read_message"]

T = TypeVar("T")

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 << 20
"""Bytes one rank's message may take (the largest, per-tensor fingerprints of a rank's
state, is tens of bytes per tensor)."""


class _Message(pickle.Unpickler):
    def __init__(self, data: bytes, allow: Iterable[type]) -> None:
        super().__init__(io.BytesIO(data))
        self._allow = {(c.__module__, c.__qualname__): c for c in allow}

    def find_class(self, module: str, name: str) -> Any:
        cls = self._allow.get((module, name))
        if cls is None and module == "builtins":
            b = getattr(builtins, name, None)
            cls = b if isinstance(b, type) and issubclass(b, BaseException) else None
        if cls is None:
            raise pickle.UnpicklingError(f"it names the global {module}.{name}")
        return cls


def read_message(data: bytes, rank: int, allow: Iterable[type] = ()) -> Any:
    """Rank ``rank``'s message: plain data, builtin exceptions and the classes in
    ``allow`` (a message naming any other global is refused, so it runs no code)."""
    try:
        return _Message(data, allow).load()
    except Exception as e:  # noqa: BLE001 - whatever the bytes hold is a refusal
        raise RuntimeError(
            f"the checkpoint's message from rank {rank} is refused ({str(e)[:200]}): only "
            "this job's own ranks may join its process groups; keep the rendezvous and "
            "MASTER_ADDR endpoints on a trusted network"
        ) from None


def _length(n: int, rank: int) -> int:
    if not 0 < n <= MAX_MESSAGE:
        raise RuntimeError(
            f"rank {rank} announced a checkpoint message of {n} bytes (at most {MAX_MESSAGE}): "
            "not a message of this job's ranks; keep its endpoints on a trusted network"
        )
    return n


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)


def _live(group: Any) -> Any:
    # None in an enabled Comm means destroyed; passing None on would mean the default group
    if group is None:
        raise RuntimeError(
            "this checkpointer left the job (preemption exit, or interpreter exit) and its "
            "process groups are destroyed; create a new Checkpointer to save or restore"
        )
    return group


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


class Comm:
    """Collectives of one checkpointer.

    ``collective=True`` (the default in an initialised job) uses its own gloo group, so a
    background save never interleaves with the training loop's collectives;
    ``collective=False`` makes this process save and restore alone (e.g. rank 0 of a DDP job
    writing replicated state by itself).
    """

    def __init__(self, collective: bool | None = None, hold: Iterable[Any] = ()) -> None:
        """``hold``: more of the job's groups to keep until :meth:`destroy` (those of the
        state's DDP wrappers), as the default group is."""
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
        # The job's default group and its DDP groups, held until :meth:`destroy` so that
        # the script's DDP Reducer is never the last holder of one (see :meth:`destroy`);
        # also when saving alone.
        self._held: list[Any] = [dist.group.WORLD, *hold] if is_dist() else []
        if self._held:  # runs after the checkpointer's own flush at exit (LIFO)
            atexit.register(self.destroy)

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.enabled else 0

    @property
    def world(self) -> int:
        return dist.get_world_size() if self.enabled else 1

    def broadcast(self, obj: T, allow: Iterable[type] = ()) -> T:
        """Rank 0's ``obj`` on every rank. ``allow``: the classes ``obj`` may hold besides
        plain data and builtin exceptions (:func:`read_message`)."""
        if not self.enabled:
            return obj
        group = _live(self.group)
        data = _encode(obj) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(n, src=0, group=group)
        if self.rank != 0:
            data = torch.empty(_length(int(n), 0), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=group)
        return obj if self.rank == 0 else read_message(data.numpy().tobytes(), 0, allow)

    def gather(self, obj: T, allow: Iterable[type] = ()) -> list[T]:
        """Every rank's ``obj``, on every rank (collective decisions need all of them);
        ``allow`` as for :meth:`broadcast`."""
        if not self.enabled:
            return [obj]
        group = _live(self.group)
        world, me = dist.get_world_size(group), self.rank
        data = _encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
        lengths = [_length(int(s), r) for r, s in enumerate(sizes)]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: data.numel()] = data
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        return [
            obj if r == me else read_message(p[:n].numpy().tobytes(), r, allow)
            for r, (p, n) in enumerate(zip(parts, lengths, strict=True))
        ]

    def any_of(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag OR-ed over all ranks (one small all-reduce on the control group)."""
        if not self.enabled:
            return tuple(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_live(self.control))
        return tuple(bool(v) for v in t.tolist())

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=_live(self.group))

    def destroy(self) -> None:
        """Destroy this checkpointer's two groups (local, idempotent); no collective may
        follow. Joins their gloo worker threads while the interpreter is intact.

        Why: a gloo worker thread drops its reference to a finished collective (and the
        tensors it used) just after the caller's ``wait()`` returns. If that happens while
        Python is finalizing, freeing a tensor that a Python object owns takes the GIL, the
        finalizing interpreter ends the thread there (``pthread_exit`` unwinding through a
        ``noexcept`` destructor), and the process aborts with "terminate called without an
        active exception" (SIGABRT) instead of its exit status. Also run at exit: until
        then this object keeps the groups alive, even past the script's own
        ``destroy_process_group()``.
        """
        groups, self.group, self.control = (self.group, self.control), None, None
        for g in groups:
            if g is not None:
                try:
                    dist.destroy_process_group(g)
                except ValueError:  # already gone with the default group
                    pass
                except Exception as e:  # noqa: BLE001 - teardown never changes how we exit
                    log.warning("destroying the checkpoint's process group failed: %s", e)
        # Last, the job's default and DDP groups (the script may have destroyed them
        # already): freed from these Python references, their gloo threads are joined with
        # the GIL released. Freed by the script's DDP Reducer instead, they are joined with
        # the GIL held, and a worker still freeing a backward's all-reduce needs the GIL to
        # do so (torch 2.13 puts a Python object in the state every backward hands to its
        # collectives): the rank hangs at exit (tests/integration/test_ddp_gloo_exit.py).
        self._held = []

    def leave(self) -> None:
        """Leave the job together: wait until every rank is here, then :meth:`destroy`.

        For the preemption exit, after the final save. No rank tears its side of the
        groups down while a peer is still in one of their collectives, and the ranks exit
        within moments of each other: torchrun stops every other worker as soon as one
        exits, and a peer still flushing would be cut short. The user's groups are left
        alone: their last collective is a whole save ago, the loop is in none of them (the
        ranks agreed on this step), and destroying them is the script's business (its own
        ``destroy_process_group()`` in a ``finally`` would then raise, turning exit status
        143 into 1).
        """
        if self.control is not None:
            try:
                dist.barrier(group=self.control)
            except Exception as e:  # noqa: BLE001 - a peer already gone: leave all the same
                log.warning("leaving without the other ranks (%s)", e)
        self.destroy()
