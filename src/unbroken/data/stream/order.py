"""The epoch order: a pure function of (dataset fingerprint, seed, epoch) -> sample ids.

Two levels (D-ORDER, D-SHUFFLE): shards are permuted every epoch, laid end to end into one
stream, and the stream is cut into fixed windows of ``shuffle_window`` samples, each
permuted by an RNG keyed by ``(fingerprint, seed, epoch, window index)``. Which sample sits
at position ``p`` needs only the shard permutation and the one window that holds ``p``:
nothing materialises the whole epoch, and a reader touches one window (a contiguous run of
at most a few shards) at a time (D-IO).

* :class:`EpochOrder`: one source's order; :class:`MixtureOrder`: several sources mixed
  with weights, exactly, block by block;
* :class:`DatasetOrder`: the order of a whole (possibly mixed) dataset as one object, that
  depends on each source's fingerprint and shard sizes, the seed, the shuffle settings and
  the weights and nothing else (no files, no torch); the dataset reads through it, and the
  remote cache derives from it the :class:`EpochPlan` of an epoch (for every shard, the
  positions at which it is read) to prefetch and evict by;
* :class:`Partition`: the positions of one run (a resume point to the epoch end) split
  across ranks and into batches; the only part that depends on world size, worker count or
  batch size, and it only *reads* the global order.

How a mixture deals its blocks: ARCHITECTURE.md, "Design notes" > data > the epoch order.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar

import numpy as np
import xxhash

__all__ = [
    "LAST_BATCH_POLICIES",
    "NEVER",
    "DatasetOrder",
    "EpochOrder",
    "EpochPlan",
    "MixtureOrder",
    "Partition",
    "default_shuffle_window",
    "random_slots",
    "seeded_rng",
    "shards_per_window",
]

# Seed-material tags keep the RNG streams of different uses apart.
_TAG_SHARDS = 1
_TAG_WINDOW = 2
_TAG_MIX = 3
_TAG_RANDOM = 4
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment
# Default window bounds: at least 256 Ki samples (a dataset that small is shuffled globally;
# 2 MiB of permutation), at most 4 Mi (32 MiB per worker).
_MIN_DEFAULT_WINDOW = 1 << 18
_MAX_DEFAULT_WINDOW = 1 << 22
_WINDOW_CACHE = 2

LAST_BATCH_POLICIES = ("pad", "drop", "short")
NEVER = np.iinfo(np.int64).max
"""An :class:`EpochPlan`'s "no known next use"."""
_ORDER_CACHE = 8  # EpochOrder / MixtureOrder objects kept per DatasetOrder (and their windows)
T = TypeVar("T")


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers: independent streams for different tuples."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0] >> 1)


def _words(n: int) -> list[int]:
    """SeedSequence's entropy words of a non-negative int (little-endian uint32s; 0 -> [0])."""
    out = [n & 0xFFFFFFFF]
    while n > 0xFFFFFFFF:
        n >>= 32
        out.append(n & 0xFFFFFFFF)
    return out


def mix_seeds(head: Sequence[int], values: np.ndarray, tail: Sequence[int]) -> np.ndarray:
    """``[mix_seed(*head, v, *tail) for v in values]`` as uint64, computed for all values at
    once: numpy's SeedSequence mixing (entropy pool of 4, hashmix/mix constants) on uint32
    columns. ~0.1 us per value instead of ~8 us per call (a batch's RNG seed)."""
    vals = np.asarray(values, dtype=np.int64)
    out = np.empty(vals.size, dtype=np.uint64)
    if vals.size and int(vals.min()) < 0:
        raise ValueError("mix_seeds: values must be non-negative")
    hw = [w for n in head for w in _words(int(n))]
    tw = [w for n in tail for w in _words(int(n))]
    u = vals.astype(np.uint64)
    for big in (False, True):  # values of one uint32 word, then of two
        sel = np.flatnonzero((u > 0xFFFFFFFF) == big)
        if not sel.size:
            continue
        v = u[sel]
        mid = [v & 0xFFFFFFFF] + ([v >> 32] if big else [])
        cols = [np.full(sel.size, c, np.uint32) for c in hw]
        cols += [m.astype(np.uint32) for m in mid]
        cols += [np.full(sel.size, c, np.uint32) for c in tw]
        cols += [np.zeros(sel.size, np.uint32)] * (4 - len(cols))
        hc = 0x43B0D7E5

        def hashmix(x: np.ndarray) -> np.ndarray:
            nonlocal hc
            x = x ^ np.uint32(hc)
            hc = (hc * 0x931E8875) & 0xFFFFFFFF
            x = x * np.uint32(hc)
            return x ^ (x >> np.uint32(16))

        def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            r: np.ndarray = np.uint32(0xCA01F9DD) * x - np.uint32(0x4973F715) * y
            return r ^ (r >> np.uint32(16))

        pool = [hashmix(cols[i]) for i in range(4)]
        for i in range(4):
            for j in range(4):
                if i != j:
                    pool[j] = mix(pool[j], hashmix(pool[i]))
        for c in cols[4:]:
            for j in range(4):
                pool[j] = mix(pool[j], hashmix(c))
        hb, state = 0x8B51F9DD, []
        for j in range(2):  # generate_state(1, uint64): two uint32 words, little-endian
            x = pool[j] ^ np.uint32(hb)
            hb = (hb * 0x58F38DED) & 0xFFFFFFFF
            x = x * np.uint32(hb)
            state.append((x ^ (x >> np.uint32(16))).astype(np.uint64))
        out[sel] = (state[0] | (state[1] << np.uint64(32))) >> np.uint64(1)
    return out


def random_slots(
    fingerprint: str, seed: int, epoch: int, positions: np.ndarray, room: int | np.ndarray
) -> np.ndarray:
    """Random windows (``DatasetConfig.windows="random"``): the start slot in ``[0, room)`` of
    the sample at each position of ``epoch``, uniform and independent per position, a pure
    function of (fingerprint, seed, epoch, position) - so the draw stream is the position: a
    resume at any position, on any layout, continues it exactly (D-ORDER, D-RESUME).
    ``room`` may be an array (each position's own). The draw at position ``p`` is SplitMix64's
    ``p``-th output from a key mixed from (fingerprint, seed, epoch): six vector operations
    per batch (SeedSequence mixing per value cost ~1 ms per batch of 16). The bias of the
    modulo is below ``room / 2**64``."""
    _check_seed(seed, epoch)
    fp = xxhash.xxh3_64_intdigest(fingerprint.encode())
    key = np.uint64(mix_seed(fp, seed, _TAG_RANDOM, epoch))
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and int(pos.min()) < 0:
        raise ValueError("random_slots: positions must be non-negative")
    z = key + (pos.astype(np.uint64) + np.uint64(1)) * _GOLDEN  # uint64 arrays wrap
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z % np.asarray(room, dtype=np.uint64)).astype(np.int64)


def seeded_rng(fingerprint: str, seed: int, *parts: int) -> np.random.Generator:
    """A numpy Generator keyed by ``(fingerprint, seed, *parts)``; same key, same stream."""
    fp = xxhash.xxh3_64_intdigest(fingerprint.encode())
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([fp, seed, *parts])))


def default_shuffle_window(counts: Sequence[int] | np.ndarray) -> int:
    """Four times the largest shard (a window mixes >= 4 shards) and at least 256 Ki samples
    or 64 shards, whichever is less (with few shards, a shard-level permutation alone leaves
    index and position correlated), capped at 4 Mi samples and at the dataset size."""
    arr = np.asarray(counts, dtype=np.int64)
    total = int(arr.sum())
    if total == 0:
        return 1
    big = int(arr.max())
    # the 256 Ki floor never spans more than 64 shards (open files, index memory per worker)
    want = max(4 * big, min(_MIN_DEFAULT_WINDOW, 64 * big))
    return max(1, min(total, want, _MAX_DEFAULT_WINDOW))


def shards_per_window(counts: Sequence[int] | np.ndarray, window: int) -> int:
    """Most shards one window can touch (whatever the shard order): the smallest shards first."""
    arr = np.sort(np.asarray(counts, dtype=np.int64))
    arr = arr[arr > 0]
    fit = int(np.searchsorted(np.cumsum(arr), window, side="left"))
    return min(arr.size, fit + 2)


def _check_seed(seed: int, epoch: int) -> None:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int; pass e.g. seed=0")
    if not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch={epoch!r} must be a non-negative int")


class EpochOrder:
    """The order of one epoch of one dataset, computed lazily window by window.

    ``counts[i]`` is the number of samples of shard ``i`` in manifest order; sample ids are
    global indexes in manifest order (shard ``i`` holds ids ``starts[i] .. starts[i+1]-1``).
    ``salt`` extends the seed material (the mixture uses it to key source epochs).
    """

    def __init__(
        self,
        counts: Sequence[int] | np.ndarray,
        fingerprint: str,
        seed: int,
        epoch: int,
        *,
        shuffle: bool = True,
        shuffle_window: int | None = None,
        salt: tuple[int, ...] = (),
    ) -> None:
        _check_seed(seed, epoch)
        arr = np.asarray(counts, dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0 or (arr < 0).any():
            raise ValueError(
                f"counts must be a non-empty 1-D sequence of non-negative sample counts, got {arr!r}"
            )
        if shuffle_window is not None and shuffle_window < 1:
            raise ValueError(
                f"shuffle_window={shuffle_window} must be >= 1 (or None for the default)"
            )
        self.fingerprint = fingerprint
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shuffle = shuffle
        self._salt = tuple(int(s) for s in salt)
        self.counts = arr
        self.length = int(arr.sum())
        self.starts = np.zeros(arr.size + 1, dtype=np.int64)
        np.cumsum(arr, out=self.starts[1:])
        if shuffle:
            rng = seeded_rng(fingerprint, self.seed, _TAG_SHARDS, self.epoch, *self._salt)
            self.shard_order = rng.permutation(arr.size).astype(np.int64)
            self.window = max(1, min(shuffle_window or default_shuffle_window(arr), self.length))
        else:
            self.shard_order = np.arange(arr.size, dtype=np.int64)
            self.window = max(1, self.length)
        # Cumulative counts of the shards in this epoch's order: stream index -> shard slot.
        self._stream_starts = np.zeros(arr.size + 1, dtype=np.int64)
        np.cumsum(arr[self.shard_order], out=self._stream_starts[1:])
        self._windows: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def num_windows(self) -> int:
        return -(-self.length // self.window)

    def window_permutation(self, k: int) -> np.ndarray:
        """Permutation of window ``k`` (cached for the last couple of windows)."""
        perm = self._windows.get(k)
        if perm is not None:
            self._windows.move_to_end(k)
            return perm
        lo = k * self.window
        size = min(self.window, self.length - lo)
        if size <= 0:
            raise IndexError(f"window {k} is past the end of an epoch of {self.length} samples")
        if self.shuffle:
            rng = seeded_rng(self.fingerprint, self.seed, _TAG_WINDOW, self.epoch, k, *self._salt)
            perm = rng.permutation(size)
        else:
            perm = np.arange(size, dtype=np.int64)
        self._windows[k] = perm
        if len(self._windows) > _WINDOW_CACHE:
            self._windows.popitem(last=False)
        return perm

    def stream_index(self, positions: np.ndarray) -> np.ndarray:
        """Position in the epoch -> index in the stream of permuted shards laid end to end."""
        pos = np.asarray(positions, dtype=np.int64)
        if not pos.size:
            return pos.copy()
        first, last = int(pos.min()), int(pos.max())
        if first < 0 or last >= self.length:
            raise IndexError(f"positions must lie in [0, {self.length}), got {first}..{last}")
        if not self.shuffle:
            return pos.copy()
        if first // self.window == last // self.window:  # one window: a batch, usually
            lo = first // self.window * self.window
            return lo + self.window_permutation(first // self.window)[pos - lo]
        out = np.empty_like(pos)
        win = pos // self.window
        for k in np.unique(win):
            sel = win == k
            lo = int(k) * self.window
            out[sel] = lo + self.window_permutation(int(k))[pos[sel] - lo]
        return out

    def ids(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Sample ids (manifest order) at the given positions of this epoch."""
        t = self.stream_index(np.asarray(positions, dtype=np.int64))
        slot = np.searchsorted(self._stream_starts, t, side="right") - 1
        shard = self.shard_order[slot]
        return self.starts[shard] + (t - self._stream_starts[slot])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample ids -> (shard index, index inside the shard)."""
        ids = np.asarray(ids, dtype=np.int64)
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        return shard, ids - self.starts[shard]

    def __getitem__(self, p: int) -> int:
        return int(self.ids(np.array([p]))[0])

    def __len__(self) -> int:
        return self.length


class MixtureOrder:
    """Weighted, deterministic interleaving of several sources for one mixture epoch.

    Positions are dealt in blocks of ``block`` slots. The number of slots source ``i`` gets
    in the first ``b`` blocks is ``floor(b*block*S_i) - floor(b*block*S_{i-1})`` where ``S`` are
    the cumulative normalised weights (exact fractions), so the realised share never drifts
    from the weights by more than one sample per source, and the count before any block is
    known in O(num_sources) without scanning earlier blocks. Each block's slots are permuted by
    an RNG keyed by ``(fingerprints, seed, epoch, block)``.
    """

    def __init__(
        self,
        weights: Sequence[float],
        fingerprint: str,
        seed: int,
        epoch: int,
        length: int,
        *,
        block: int = 4096,
    ) -> None:
        _check_seed(seed, epoch)
        if len(weights) < 1 or any(not (w > 0) or not math.isfinite(w) for w in weights):
            raise ValueError(
                f"mixture weights must be positive finite numbers, got {list(weights)}"
            )
        if block < 1:
            raise ValueError(f"mix block={block} must be >= 1")
        fracs = [Fraction(w).limit_denominator(1 << 30) for w in weights]
        total = sum(fracs)
        norm = [f / total for f in fracs]
        if min(norm) * block < 1:
            raise ValueError(
                f"mixture weight {float(min(norm)):.3g} is below 1/block = 1/{block}: that source "
                f"would get no slot in some blocks; raise the weight or pass a larger mix block"
            )
        self.weights = tuple(float(f) for f in norm)
        self.cum = [sum(norm[: i + 1], Fraction(0)) for i in range(len(norm))]
        self.block = int(block)
        self.length = int(length)
        self.fingerprint = fingerprint
        self.seed = int(seed)
        self.epoch = int(epoch)
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _before(self, b: int) -> np.ndarray:
        """Per-source slot counts in blocks ``0..b-1``."""
        n = b * self.block
        d = [0] + [math.floor(n * c) for c in self.cum]
        return np.diff(np.asarray(d, dtype=np.int64))

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, source-local offset of each slot) for block ``b``."""
        hit = self._blocks.get(b)
        if hit is not None:
            return hit
        base = self._before(b)
        counts = self._before(b + 1) - base
        src = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        rng = seeded_rng(self.fingerprint, self.seed, _TAG_MIX, self.epoch, b)
        src = src[rng.permutation(src.size)]
        # rank of each slot among the slots of its own source, plus the count before the block
        onehot = src[None, :] == np.arange(len(counts))[:, None]
        rank = (np.cumsum(onehot, axis=1) - 1)[src, np.arange(src.size)]
        hit = (src, base[src] + rank)
        self._blocks[b] = hit
        if len(self._blocks) > _WINDOW_CACHE:
            self._blocks.popitem(last=False)
        return hit

    def assign(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mixture positions -> (source index, position in that source's stream)."""
        pos = np.asarray(positions, dtype=np.int64)
        src = np.empty_like(pos)
        off = np.empty_like(pos)
        blk = pos // self.block
        for b in np.unique(blk):
            sel = blk == b
            s, o = self._block(int(b))
            slot = pos[sel] - int(b) * self.block
            src[sel] = s[slot]
            off[sel] = o[slot]
        return src, off


@dataclass(frozen=True)
class Partition:
    """One run's share of an epoch: positions ``[start, epoch_len)`` over ranks and batches.

    A *global step* takes the next ``world_size * batch_size`` positions of the run; rank
    ``r`` gets the positions ``start + step*G + r + world_size*j`` for ``j < batch_size``
    (interleaved, so a short last step is split evenly). Positions are counted from the
    run's ``start`` (the resume point), not from 0, so a run can resume at any position
    with any world size. ``samples_consumed`` after ``k`` whole global steps is
    ``start + k*G`` (capped at ``epoch_len``): consumption is counted in whole global steps,
    which is what every rank has delivered at an optimizer-step boundary.

    ``last_batch`` decides the final global step when ``epoch_len - start`` is not a multiple
    of ``G``: ``"pad"`` fills it with the positions just before that step again, the latest
    first (every rank gets the same number of full batches, at most ``G-1`` samples repeat,
    none twice inside the step when ``epoch_len >= G``); they lie in the epoch's last shuffle
    window, whose shards a remote dataset's node cache still holds - the epoch's *first*
    positions (DistributedSampler's padding) were evicted long before and would be
    downloaded again (issue 22). ``"drop"`` drops those ``< G`` samples for this epoch,
    ``"short"`` yields a shorter last step (ranks whose share is empty skip it, so use it
    only when ranks need not stay in lockstep).
    """

    start: int
    epoch_len: int
    batch_size: int
    rank: int = 0
    world_size: int = 1
    last_batch: str = "pad"

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank={self.rank} world_size={self.world_size}: need 0 <= rank < world_size"
            )
        if self.last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch={self.last_batch!r} is not one of {LAST_BATCH_POLICIES}")
        if not 0 <= self.start <= self.epoch_len:
            raise ValueError(
                f"start={self.start} must lie in [0, epoch_len={self.epoch_len}]; the resume "
                "state is past the end of this epoch"
            )

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def num_steps(self) -> int:
        """Global steps of this run until the epoch ends."""
        rest = self.epoch_len - self.start
        if self.last_batch == "drop":
            return rest // self.global_batch
        return -(-rest // self.global_batch)

    @property
    def end(self) -> int:
        """One past the last (possibly padded) position of the run."""
        if self.last_batch == "pad":
            return self.start + self.num_steps * self.global_batch
        if self.last_batch == "drop":
            return self.start + self.num_steps * self.global_batch
        return self.epoch_len

    def num_batches(self) -> int:
        """Batches this rank yields (``short`` may give the last step no share)."""
        steps = self.num_steps
        if steps and self.last_batch == "short":
            first_of_last = self.start + (steps - 1) * self.global_batch
            if first_of_last + self.rank >= self.epoch_len:
                return steps - 1
        return steps

    def batch_positions(self, step: int) -> np.ndarray:
        """Epoch positions of this rank's batch at global ``step`` (the padded slots
        ``epoch_len + j`` of the last step read position ``last - 1 - j``, ``last`` being
        that step's first position: a function of the step alone, so a resume at any
        consumed position pads the same)."""
        lo = self.start + step * self.global_batch + self.rank
        pos = lo + self.world_size * np.arange(self.batch_size, dtype=np.int64)
        pos = pos[pos < self.end]
        if self.last_batch == "pad" and pos.size and pos[-1] >= self.epoch_len:
            last = self.start + (self.num_steps - 1) * self.global_batch
            back = (last - 1 - (pos - self.epoch_len)) % max(1, self.epoch_len)
            pos = np.where(pos >= self.epoch_len, back, pos)
        return pos

    def consumed_after(self, steps: int) -> int:
        """Global samples consumed in the epoch after ``steps`` whole global steps."""
        return min(self.epoch_len, self.start + steps * self.global_batch)


# --- the order of a whole dataset, and the plan of an epoch ------------------------------


@dataclass(frozen=True)
class EpochPlan:
    """For one epoch: every (unit, [lo, hi)) span of positions in which a shard is read, a
    unit being a shard numbered from its source's base (``DatasetOrder.plan``'s ``bases``).

    ``uid/lo/hi`` are sorted by ``lo`` (the prefetch order); ``key``/``key_lo`` index the same
    spans by ``uid * (L + 1) + hi`` for next-use queries.
    """

    epoch: int
    length: int
    uid: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    key: np.ndarray
    key_lo: np.ndarray

    def overlaps(self, uids: np.ndarray, p: int, q: int) -> np.ndarray:
        """Whether each unit is read somewhere in positions ``[p, q]``."""
        s = self.length + 1
        i = np.searchsorted(self.key, uids * s + p, side="right")
        ok = i < self.key.size
        j = np.minimum(i, max(self.key.size - 1, 0))
        return ok & (self.key[j] // s == uids) & (self.key_lo[j] <= q)

    def next_use(self, uids: np.ndarray, p: int) -> np.ndarray:
        """Absolute position (epoch * (L+1) + pos) of each unit's next read at or after
        ``p`` in this epoch; :data:`NEVER` where none."""
        s = self.length + 1
        i = np.searchsorted(self.key, uids * s + p, side="right")
        j = np.minimum(i, max(self.key.size - 1, 0))
        out = np.full(uids.size, NEVER, dtype=np.int64)
        if self.key.size == 0:
            return out
        ok = (i < self.key.size) & (self.key[j] // s == uids)
        out[ok] = self.epoch * s + np.maximum(self.key_lo[j[ok]], p)
        return out


def _spans(order: EpochOrder) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, lo, hi) of one source pass in its own positions: a shard is read in every
    shuffle window its stretch of the permuted shard stream overlaps."""
    counts = np.asarray(order.counts, dtype=np.int64)
    shard = np.asarray(order.shard_order, dtype=np.int64)
    ends = np.cumsum(counts[shard])
    starts = ends - counts[shard]
    keep = counts[shard] > 0
    shard, starts, ends = shard[keep], starts[keep], ends[keep]
    if not order.shuffle:
        return shard, starts, ends
    w = int(order.window)
    return shard, (starts // w) * w, np.minimum(order.length, ((ends - 1) // w + 1) * w)


class DatasetOrder:
    """The sample order of a dataset of one or several sources: D-ORDER as one object.

    A pure function of each source's fingerprint and shard sizes (``counts``: samples per
    shard, manifest order), the seed, the shuffle settings and the mixture's weights; it reads
    no file and needs no torch, so it travels to the remote cache's fetcher process. Position
    ``p`` of epoch ``e`` is :meth:`lookup`; :meth:`plan` says where each shard is read.

    ``fingerprint`` identifies the dataset (and keys the order): a single source's own, or
    for a mixture a hash of the sources' fingerprints, the weights, the epoch length and the
    block. ``windows[i]`` is source ``i``'s shuffle window (0: no shuffle).
    """

    def __init__(
        self,
        counts: Sequence[np.ndarray],
        fingerprints: Sequence[str],
        *,
        seed: int,
        shuffle: bool = True,
        shuffle_window: int | None = None,
        weights: Sequence[float] = (1.0,),
        samples_per_epoch: int | None = None,
        mix_block: int = 4096,
    ) -> None:
        self.counts = tuple(np.asarray(c, dtype=np.int64) for c in counts)
        self.fingerprints = tuple(str(f) for f in fingerprints)
        self.sizes = tuple(int(c.sum()) for c in self.counts)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.mix_block = int(mix_block)
        self.windows = tuple(
            (shuffle_window or default_shuffle_window(c)) if shuffle else 0 for c in self.counts
        )
        if len(self.counts) == 1:
            if samples_per_epoch is not None:
                raise ValueError(
                    "samples_per_epoch applies to mixtures of several sources; an epoch of one "
                    f"dataset is its {self.sizes[0]} samples - drop samples_per_epoch"
                )
            self.length = self.sizes[0]
            self.fingerprint = self.fingerprints[0]
            self.weights: tuple[float, ...] = (1.0,)
        else:
            self.length = int(samples_per_epoch or sum(self.sizes))
            # normalises the weights, and refuses them against mix_block now, not in a worker
            self.weights = MixtureOrder(weights, "", 0, 0, 1, block=mix_block).weights
            parts = [f"{f}:{w!r}" for f, w in zip(self.fingerprints, self.weights, strict=True)]
            self.fingerprint = xxhash.xxh3_128_hexdigest(
                ("mix/" + ",".join(parts) + f"/{self.length}/{mix_block}").encode()
            )
        self._orders: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_orders": OrderedDict(), "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def clone(self) -> DatasetOrder:
        """The same order with caches of its own (planning in one place must not push a
        reader's windows out of the other's)."""
        twin = object.__new__(DatasetOrder)
        twin.__setstate__(self.__getstate__())
        return twin

    def _cached(self, key: tuple[int, ...], make: Callable[[], T]) -> T:
        with self._lock:  # the cache's threads plan while a reader looks up
            hit = self._orders.get(key)
            if hit is not None:
                self._orders.move_to_end(key)
                return hit
        made = make()
        with self._lock:
            self._orders[key] = made
            if len(self._orders) > _ORDER_CACHE:
                self._orders.popitem(last=False)
        return made

    def pass_order(self, i: int, epoch: int, k: int = 0) -> EpochOrder:
        """Source ``i``'s ``k``-th pass inside ``epoch`` (a mixture epoch may go over a source
        more than once; a single source has one pass, ``k = 0``)."""
        salt = () if len(self.counts) == 1 else (i, k)
        return self._cached(
            (i, epoch, *salt),
            lambda: EpochOrder(
                self.counts[i],
                self.fingerprints[i],
                self.seed,
                epoch,
                shuffle=self.shuffle,
                shuffle_window=self.windows[i] or None,
                salt=salt,
            ),
        )

    def mixture(self, epoch: int) -> MixtureOrder:
        return self._cached(
            (-1, epoch),
            lambda: MixtureOrder(
                self.weights, self.fingerprint, self.seed, epoch, self.length, block=self.mix_block
            ),
        )

    def lookup(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Epoch positions -> (source index, sample id in that source's manifest order)."""
        pos = np.asarray(positions, dtype=np.int64)
        if len(self.counts) == 1:
            return np.zeros_like(pos), self.pass_order(0, epoch).ids(pos)
        src, off = self.mixture(epoch).assign(pos)
        ids = np.empty_like(pos)
        for i in np.unique(src).tolist():
            sel = src == i
            rep, rest = np.divmod(off[sel], self.sizes[i])
            part = np.empty_like(rest)
            for k in np.unique(rep).tolist():
                m = rep == k
                part[m] = self.pass_order(i, epoch, k).ids(rest[m])
            ids[sel] = part
        return src, ids

    def _blocks_before(self, i: int, nblocks: int) -> np.ndarray:
        """Slots of source ``i`` in mixture blocks ``0..b-1`` for every ``b <= nblocks``: the
        same cumulative floors as :class:`MixtureOrder`, exactly, in int64
        (``floor(n*p/q) = (n//q)*p + (n%q)*p//q`` keeps every product below 2**62)."""
        cum = MixtureOrder(self.weights, "", 0, 0, 1, block=self.mix_block).cum
        n = np.arange(nblocks + 1, dtype=np.int64) * self.mix_block

        def floor_at(k: int) -> np.ndarray:
            if k < 0:
                return np.zeros_like(n)
            p, q = cum[k].numerator, cum[k].denominator
            return (n // q) * p + (n % q) * p // q

        return floor_at(i) - floor_at(i - 1)

    def _source_spans(self, i: int, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, lo, hi) of source ``i`` in mixture positions: source offset o (counted
        across passes) lies in the block b with before(b) <= o < before(b+1), anywhere among
        its positions (a block's slots are permuted)."""
        if len(self.counts) == 1:
            return _spans(self.pass_order(i, epoch))
        length, blk, n = self.length, self.mix_block, self.sizes[i]
        before = self._blocks_before(i, -(-length // blk))
        parts = []
        for k in range(-(-int(before[-1]) // n)):
            ps, a, b = _spans(self.pass_order(i, epoch, k))
            first = np.searchsorted(before, a + k * n, side="right") - 1
            last = np.searchsorted(before, b - 1 + k * n, side="right") - 1
            parts.append(
                (ps, np.minimum(first * blk, length), np.minimum((last + 1) * blk, length))
            )
        sh, lo, hi = (np.concatenate([q[j] for q in parts]) for j in range(3))
        keep = lo < hi
        return sh[keep], lo[keep], hi[keep]

    def plan(self, epoch: int, bases: dict[int, int]) -> EpochPlan:
        """The plan of ``epoch`` for the sources ``{source index: unit of its shard 0}``: every
        span of positions in which a shard is read."""
        uids, los, his = [], [], []
        for i, base in bases.items():
            sh, lo, hi = self._source_spans(i, epoch)
            uids.append(sh + base)
            los.append(lo)
            his.append(hi)
        uid = np.concatenate(uids).astype(np.int64)
        lo = np.concatenate(los).astype(np.int64)
        hi = np.concatenate(his).astype(np.int64)
        o = np.lexsort((uid, lo))
        key = uid * (self.length + 1) + hi
        ko = np.argsort(key, kind="stable")
        return EpochPlan(epoch, self.length, uid[o], lo[o], hi[o], key[ko], lo[ko])
