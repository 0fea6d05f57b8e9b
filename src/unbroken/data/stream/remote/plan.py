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
import logging
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
    "fit_to_limit",
    "min_limit",
    "next_uses",
    "prefetch_targets",
    "window_units",
]

log = logging.getLogger(__name__)

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
    {remote source index: bytes of each of its units}. The index files kept after their
    shards' eviction are not in it: a read that needs their room takes it (``units.py``)."""
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
    """Prefetch depth when ``prefetch_shards`` is not given: three quarters of the room the
    limit leaves beyond the one window the readers are in (``need``: :func:`min_limit` with
    one window's read-ahead), at least one window's worth and at most four. The quarter left
    free is what a reader's next shard is admitted into without evicting a prefetched one.

    Beyond *one* window, not two: :func:`min_limit` holds room for a second window because
    readers may straddle a window boundary, but that room is free whenever they do not, and a
    prefetch never evicts a unit needed sooner (it waits for room instead). With one window of
    read-ahead (the least limit, where defaults fitted to a small cache land) the next
    window's shards became targets only as the readers entered the current one and came in
    one burst the readers caught up with at every boundary (issue 22 round 3: 4 MB shards,
    25% cache, 25-78 waits per epoch); 1.5 windows spreads them over the window before.
    Measured on the issue-14 bench (cache = 25% of the dataset): 9 -> 14 shards ahead, epoch
    1 24k -> 28k samples/s, same bytes; the whole room (19) downloaded 3-7% more."""
    if limit is None:
        return window
    room = (limit - need) // max(biggest, 1) + 2 * window  # shards beyond one window
    return int(min(max(window, room * 3 // 4), 4 * window))


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The largest ``x`` in ``[lo, hi]`` with ``ok(x)`` (``ok`` true below some point), or None."""
    if lo > hi or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def near_pairs(order: DatasetOrder, n: int = 1 << 16) -> float:
    """Share of consecutive samples of epoch 0's first ``n`` positions from the same source
    whose ids are < 1000 apart (the shuffle-quality figure of ``benchmarks/data_read.py``)."""
    src, ids = order.lookup(0, np.arange(min(order.length, n), dtype=np.int64))
    if ids.size < 2:
        return 0.0
    near = (src[1:] == src[:-1]) & (np.abs(np.diff(ids)) < 1000)
    return float(near.mean())


def fit_to_limit(
    order_for: Callable[[int | None], DatasetOrder],
    units: dict[int, np.ndarray],
    limit: int,
    cap_bytes: int | None,
    manifest_bytes: int,
    *,
    window: int | None = None,
    prefetch: int | None = None,
) -> tuple[int | None, int | None]:
    """Defaults that fit the cache (issue 22 item 3): ``(shuffle_window, prefetch_shards)``
    to use instead of the defaults, None where the default (or the caller's ``window`` /
    ``prefetch``, never changed) stays. ``order_for(w)``: the dataset's order with shuffle
    window ``w`` (None: the default).

    When ``limit`` holds the order's two windows plus one window's read-ahead
    (:func:`min_limit`), nothing changes. Else the largest window from one shard's samples
    up to the default that fits with that read-ahead; else one shard's window (or the given
    one) with the largest read-ahead that fits; said in one WARNING line with the shuffle
    quality (shards per window, near-pair rate). Refused (``ValueError`` naming the least
    limit that works) only when not even that window fits with no read-ahead."""

    def need(w: int | None, p: int | None) -> tuple[int, str]:
        o = order_for(w)
        k = sum(window_units(o, i) for i in units) if p is None else p
        return min_limit(o, units, k, cap_bytes, manifest_bytes)

    default = order_for(window)
    need0 = need(window, prefetch)[0]
    if need0 <= limit:
        return None, None
    one = max(int(default.counts[i].max()) for i in units)  # one (largest) shard's samples
    top = max(default.windows[i] for i in units)
    w = None
    if window is None:
        w = _largest(min(one, top), top, lambda x: need(x, prefetch)[0] <= limit)
    p = None
    if w is None and prefetch is None:
        small = window if window is not None else min(one, top)
        k = sum(window_units(order_for(small), i) for i in units)
        p = _largest(0, k, lambda x: need(small, x)[0] <= limit)
        w = None if p is None else small
    if w is None:
        least_w = window if window is not None else min(one, top)
        least, why = need(least_w, prefetch if prefetch is not None else 0)
        ahead = f"prefetch_shards={prefetch}" if prefetch is not None else "no read-ahead"
        raise ValueError(
            f"cache_limit={limit:,} bytes is too small: {why}, with the smallest shuffle "
            f"window tried ({least_w:,} samples: one shard's, or the one given) and {ahead}; "
            f"pass cache_limit >= {least:,}"
        )
    chosen = order_for(w)
    spw = sum(window_units(chosen, i) for i in units)
    spw0 = sum(window_units(default, i) for i in units)
    ahead = f"{p} shards" if p is not None else f"at least {prefetch or spw} shards"
    log.warning(
        "cache_limit=%s bytes cannot hold the shuffle window and read-ahead asked for "
        "(%s bytes): using shuffle_window=%s (%d shards per window, near pairs %.1f%%; "
        "asked for: %d shards per window, %.1f%%) and a read-ahead of %s; pass "
        "cache_limit >= %s to keep them, or choose shuffle_window= / "
        "CacheConfig(prefetch_shards=) yourself",
        f"{limit:,}",
        f"{need0:,}",
        f"{w:,}",
        spw,
        100 * near_pairs(chosen),
        spw0,
        100 * near_pairs(default),
        ahead,
        f"{need0:,}",
    )
    return (None if window is not None else w), p


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
    next_epoch: int | None = None,
) -> tuple[list[tuple[int, int]], int]:
    """The units read at position ``p`` of ``plan.epoch``, then the next ``want`` (at most
    ``cap`` bytes of them) in plan order, continuing into ``after()`` (the next epoch's plan)
    near the end of this one, for at most ``next_epoch`` units of it (None: ``want``):
    [(unit, absolute position of its first use)], and the next position at which that set
    changes."""
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
            if next_epoch is not None:
                want = min(want, got + next_epoch)
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
