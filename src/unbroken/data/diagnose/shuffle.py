"""Shuffle quality: per-epoch statistics of the order a StreamingDataset produces.

For an epoch of ``n`` samples with sample id ``i`` (manifest order) at position ``p(i)``:

* ``displacement``: mean ``|p(i) - i| / n``. A uniform random permutation gives
  ``(n^2 - 1) / (3 n^2)`` (about 1/3); ``vs_random`` is the ratio to that (1.0 = as far as
  random, 0 = unshuffled).
* ``spearman``: rank correlation between original index and position (for a permutation
  Spearman and Pearson coincide): ~0 for a good shuffle, 1 for none.
* ``same_shard``: share of consecutive pairs that come from the same shard, next to
  ``same_shard_random``, its expectation under a uniform random permutation. A two-level
  shuffle mixing ``k`` shards per window sits near ``1/k``; reading shard by shard gives ~1.
* ``first_shards``: the start of the epoch's shard permutation (level 1).
* ``prev_epoch``: Spearman correlation of positions with the previous epoch's (0 = epochs
  independent), computed when the dataset has at most 10 M samples.

Everything streams window by window, so inspecting a large dataset needs memory for one chunk
(plus ``8 n`` bytes for the epoch-to-epoch correlation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from unbroken.common.tables import render_table
from unbroken.data.stream.dataset import StreamingDataset

__all__ = ["EpochShuffleStats", "format_shuffle_stats", "shuffle_stats"]

_CHUNK = 1 << 20
_MAX_PREV = 10_000_000


@dataclass(frozen=True)
class EpochShuffleStats:
    """Statistics of one epoch (see the module docstring for each field)."""

    epoch: int
    samples: int
    displacement: float
    vs_random: float
    spearman: float
    same_shard: float
    same_shard_random: float
    prev_epoch: float | None
    first_shards: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["first_shards"] = list(self.first_shards)
        return d


def _spearman(sum_d2: float, n: int) -> float:
    return 1.0 - 6.0 * sum_d2 / (n * (n * n - 1.0)) if n > 1 else 0.0


def shuffle_stats(ds: StreamingDataset, epochs: int = 3) -> list[EpochShuffleStats]:
    """Statistics of epochs ``0 .. epochs-1`` of a single-source dataset."""
    if len(ds.sources) != 1:
        raise ValueError("shuffle_stats inspects one dataset; pass a single directory")
    if epochs < 1:
        raise ValueError(f"epochs={epochs} must be >= 1")
    n = ds.epoch_length
    counts = ds.order.counts[0].astype(np.float64)
    same_random = float((counts * (counts - 1)).sum() / (n * (n - 1.0))) if n > 1 else 1.0
    random_disp = (n * n - 1.0) / (3.0 * n * n)
    prev: np.ndarray | None = None
    out: list[EpochShuffleStats] = []
    for epoch in range(epochs):
        pos_of = np.empty(n, dtype=np.int64) if n <= _MAX_PREV else None
        abs_d = 0.0
        sum_d2 = 0.0
        pairs = 0
        last_shard = -1
        order = ds.order.pass_order(0, epoch)
        first = order.shard_order[:8].tolist()
        for lo in range(0, n, _CHUNK):
            pos = np.arange(lo, min(n, lo + _CHUNK), dtype=np.int64)
            _, ids = ds.lookup(epoch, pos)
            d = (pos - ids).astype(np.float64)
            abs_d += float(np.abs(d).sum())
            sum_d2 += float((d * d).sum())
            shard, _ = order.locate(ids)
            pairs += int((shard[1:] == shard[:-1]).sum()) + int(shard[0] == last_shard)
            last_shard = int(shard[-1])
            if pos_of is not None:
                pos_of[ids] = pos
        prev_corr = None
        if pos_of is not None and prev is not None:
            dd = (pos_of - prev).astype(np.float64)
            prev_corr = _spearman(float((dd * dd).sum()), n)
        prev = pos_of
        disp = abs_d / n / max(1, n)
        out.append(
            EpochShuffleStats(
                epoch=epoch,
                samples=n,
                displacement=disp,
                vs_random=disp / random_disp if n > 1 else 0.0,
                spearman=_spearman(sum_d2, n),
                same_shard=pairs / (n - 1) if n > 1 else 1.0,
                same_shard_random=same_random,
                prev_epoch=prev_corr,
                first_shards=tuple(first),
            )
        )
    return out


def format_shuffle_stats(ds: StreamingDataset, stats: list[EpochShuffleStats]) -> str:
    """A table a person can read, with one line saying what good values look like."""
    shards = ds.order.counts[0].size
    window = ds.shuffle_window[0]
    mean_shard = ds.epoch_length / max(1, shards)
    head = (
        f"{ds.sources[0].root}: {ds.kind} dataset, {ds.epoch_length} samples in {shards} shards, "
        f"fingerprint {ds.fingerprint[:16]}\n"
        f"seed {ds.config.seed}, shuffle window "
        + (f"{window} samples (~{window / mean_shard:.1f} shards)" if window else "off")
    )
    rows = [
        (
            "epoch",
            "|disp|/n",
            "vs random",
            "spearman",
            "same-shard pairs",
            "random",
            "vs prev epoch",
            "first shards",
        ),
    ]
    for s in stats:
        rows.append(
            (
                str(s.epoch),
                f"{s.displacement:.4f}",
                f"{s.vs_random:.3f}",
                f"{s.spearman:+.4f}",
                f"{s.same_shard:.4f}",
                f"{s.same_shard_random:.4f}",
                "-" if s.prev_epoch is None else f"{s.prev_epoch:+.4f}",
                " ".join(map(str, s.first_shards)),
            )
        )
    table = render_table(rows)
    guide = (
        "good shuffle: vs random near 1, spearman and vs-prev-epoch near 0, same-shard pairs "
        "near 1/(shards per window) - 1.0 would mean reading shard by shard"
    )
    return f"{head}\n{table}\n{guide}"
