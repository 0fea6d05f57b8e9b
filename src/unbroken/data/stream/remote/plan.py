"""What the node cache fetches and evicts, and how much room it needs.

The epoch plan (:meth:`unbroken.data.stream.order.DatasetOrder.plan`) says for every shard
where an epoch reads it. From it: the units to fetch at a position (those read there, then the
next ``prefetch_shards`` in plan order, into the next epoch near the end of one), and the next
use of every cached unit, by which eviction picks its victims (the one read farthest in the
future first: Belady's rule, exact here because the future is known). And the budget: the
least ``cache_limit`` that holds two consecutive shuffle windows, the prefetch and the cache's
own files, and the bytes those files take now.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import numpy as np

from unbroken.data.stream.order import NEVER, DatasetOrder, EpochPlan, shards_per_window
from unbroken.data.stream.remote.events import EVENTS_MAX
from unbroken.data.stream.remote.index import HEADER, RECORD_BYTES

__all__ = [
    "ALLOWANCE",
    "LOG_MAX",
    "bookkeeping_bytes",
    "default_depth",
    "min_limit",
    "next_uses",
    "prefetch_targets",
    "window_units",
]

LOG_MAX = 16 << 10
"""A fetcher process's log is kept within this (and counted at it)."""
ALLOWANCE = 16 << 10
"""What may start between two admissions (a reader's registration, a slot file)."""


def window_units(order: DatasetOrder, i: int) -> int:
    """Most shards of source ``i`` one shuffle window touches."""
    w = order.windows[i]
    return shards_per_window(order.counts[i], w) if w else 2


def min_limit(
    order: DatasetOrder,
    units: dict[int, np.ndarray],
    prefetch_shards: int,
    cap_bytes: int | None,
    manifest_bytes: int,
) -> tuple[int, str]:
    """Bytes the cache must hold at least, and how that figure is made up. ``units``:
    {remote source index: bytes of each of its units}."""
    held = count = 0
    parts = []
    largest = []
    for i, unit_bytes in units.items():
        sizes = np.sort(unit_bytes)[::-1]
        w = order.windows[i]
        if len(order.counts) > 1:
            # a mixture block's slots are permuted: one block holds ~block*weight samples of
            # this source, which its readers need at once
            w += int(np.ceil(order.mix_block * order.weights[i]))
        k = shards_per_window(order.counts[i], 2 * w) if w else 2
        held += int(sizes[:k].sum())
        count += k
        parts.append(f"{k} shards of up to {int(sizes[0]):,} bytes")
        largest.append(sizes)
    every = np.sort(np.concatenate(largest))[::-1]
    ahead = int(every[:prefetch_shards].sum())
    if cap_bytes is not None:
        ahead = min(ahead, cap_bytes + int(every[0]))
    records = count + prefetch_shards + 8  # the records of what it must hold, and some
    own = HEADER + RECORD_BYTES * records + 2 * EVENTS_MAX + LOG_MAX + ALLOWANCE + manifest_bytes
    why = (
        f"two consecutive shuffle windows (and mixture blocks) need {held:,} bytes "
        f"({'; '.join(parts)}), prefetching {prefetch_shards} shards ahead {ahead:,} and the "
        f"cache's own files (manifest, index, event log) about {own:,}"
    )
    return held + ahead + own, why


def default_depth(window: int, limit: int | None, need: int, biggest: int) -> int:
    """Prefetch depth when ``prefetch_shards`` is not given: one shuffle window's worth,
    deepened to three quarters of the room the limit leaves beyond two windows (at most four
    windows' worth). The quarter left free is what a reader's next shard is admitted into
    without evicting a prefetched one. Measured on the issue-14 bench (cache = 25% of the
    dataset): 9 -> 14 shards ahead, epoch 1 24k -> 28k samples/s, same bytes; the whole room
    (19) downloaded 3-7% more and was no faster."""
    if limit is None:
        return window
    room = (limit - need) // max(biggest, 1) + window  # shards beyond two windows
    return int(min(max(window, room * 3 // 4), 4 * window))


def bookkeeping_bytes(cache_dir: str, records: int, events: int) -> int:
    """Bytes of the cache's own files (issue 20 item 10): ``.index`` at ``records``
    records; the event log (``events`` bytes now) at its bound; each fetcher log at its bound;
    the manifest copies, registrations and wait slots as they are now; plus
    :data:`ALLOWANCE`."""
    total = HEADER + RECORD_BYTES * records + ALLOWANCE + max(events, 2 * EVENTS_MAX)
    for sub in (".readers", ".stats", ".fetch"):
        with contextlib.suppress(OSError), os.scandir(os.path.join(cache_dir, sub)) as it:
            for e in it:
                if e.name.endswith(".log"):
                    total += LOG_MAX
                    continue
                with contextlib.suppress(OSError):
                    total += e.stat(follow_symlinks=False).st_size
    with contextlib.suppress(OSError), os.scandir(cache_dir) as it:
        for e in it:
            if len(e.name) == 16 and not e.name.startswith("."):
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(e.path, "dataset.json")).st_size
    return total


def prefetch_targets(
    plan: EpochPlan,
    after: Callable[[], EpochPlan],
    p: int,
    want: int,
    cap: int | None,
    unit_bytes: np.ndarray,
) -> tuple[list[tuple[int, int]], int]:
    """The units read at position ``p`` of ``plan.epoch``, then the next ``want`` (at most
    ``cap`` bytes of them) in plan order, continuing into ``after()`` (the next epoch's plan)
    near the end of this one: [(unit, absolute position of its first use)], and the next
    position at which that set changes."""
    s = plan.length + 1
    cut = int(np.searchsorted(plan.lo, p, side="right"))
    cur = plan.uid[:cut][plan.hi[:cut] > p]
    bound = int(plan.hi[:cut][plan.hi[:cut] > p].min()) if cur.size else plan.length
    if cut < plan.lo.size:
        bound = min(bound, int(plan.lo[cut]))
    targets = [(int(u), plan.epoch * s + p) for u in dict.fromkeys(cur.tolist())]
    seen = {u for u, _ in targets}
    got = nbytes = 0
    ahead, start = plan, cut
    while got < want:
        if start >= ahead.uid.size:
            if ahead is not plan:
                break
            ahead, start = after(), 0
            continue
        stop = start + 4 * want + 64  # a slice at a time: plans can be long
        for u, lo in zip(
            ahead.uid[start:stop].tolist(), ahead.lo[start:stop].tolist(), strict=True
        ):
            if u in seen:
                continue
            b = int(unit_bytes[u])
            if cap is not None and got and nbytes + b > cap:
                return targets, bound
            seen.add(u)
            targets.append((u, ahead.epoch * s + lo))
            got += 1
            nbytes += b
            if got >= want:
                break
        start = stop
    return targets, bound


def next_uses(
    plan: Callable[[int], EpochPlan], uids: np.ndarray, e0: int, p0: int, top: int
) -> np.ndarray:
    """Absolute position of each unit's next read, seen from the slowest reader (epoch
    ``e0``, position ``p0``; the latest reader is in epoch ``top``); :data:`NEVER` where it
    is not read within the next epochs."""
    left = np.ones(uids.size, dtype=bool)
    val = np.full(uids.size, NEVER, dtype=np.int64)
    for e in range(e0, min(top, e0 + 2) + 2):
        if not left.any():
            break
        got = plan(e).next_use(uids, p0 if e == e0 else 0)
        hit = left & (got != NEVER)
        val[hit] = got[hit]
        left &= ~hit
    return val
