"""Defaults that fit the cache (issue 22 item 3): when ``cache_limit`` cannot hold the default
shuffle window plus read-ahead, the largest window and read-ahead that fit are chosen and said
in one line (shards per window, near-pair rate); only a limit below one shard's window with no
read-ahead is refused, naming the smallest limit that works."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from unbroken.data.stream.order import DatasetOrder, shards_per_window
from unbroken.data.stream.remote import plan

SHARDS, PER_SHARD, UNIT = 200, 100, 64 << 20  # 64 MB shards of 100 samples
COUNTS = np.full(SHARDS, PER_SHARD, dtype=np.int64)
UNITS = {0: np.full(SHARDS, UNIT, dtype=np.int64)}
MB = 10_000  # manifest bytes


def _order(window: int | None) -> DatasetOrder:
    return DatasetOrder([COUNTS], ["f" * 32], seed=0, shuffle_window=window)


def _need(window: int | None, prefetch: int | None = None) -> int:
    o = _order(window)
    p = plan.window_units(o, 0) if prefetch is None else prefetch
    return plan.min_limit(o, UNITS, p, None, MB)[0]


def _fit(limit: int, **kw: Any) -> tuple[int | None, int | None]:
    return plan.fit_to_limit(_order, UNITS, limit, None, MB, **kw)


def test_the_default_is_kept_when_it_fits(caplog: pytest.LogCaptureFixture) -> None:
    """issue 22 item 3: a limit that holds the default changes nothing and says nothing."""
    with caplog.at_level(logging.INFO):
        assert _fit(_need(None)) == (None, None)
    assert [r for r in caplog.records if r.name.startswith("unbroken")] == []


def test_the_largest_window_that_fits_is_chosen_and_said_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """issue 22 item 3: 64 MB shards, cache 25% of the dataset: the default window (the whole
    dataset here) does not fit; the largest window whose two windows plus one window's
    read-ahead fit is chosen (one more sample would not fit), in one log line naming the
    shards per window and the near-pair rate."""
    limit = SHARDS * UNIT // 4
    assert _need(None) > limit
    with caplog.at_level(logging.INFO, logger="unbroken"):
        window, prefetch = _fit(limit)
    assert window is not None and prefetch is None
    assert _need(window) <= limit < _need(window + 1)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("unbroken")]
    assert len(lines) == 1, lines
    k = shards_per_window(COUNTS, window)
    assert f"shuffle_window={window:,}" in lines[0] and f"{k} shards per window" in lines[0]
    assert "near pairs" in lines[0] and f"cache_limit={limit:,}" in lines[0]
    assert caplog.records[-1].levelno == logging.WARNING


def test_when_only_one_shards_window_fits_the_read_ahead_shrinks() -> None:
    """issue 22 item 3: a limit between one shard's window without and with its read-ahead:
    that window, and the largest read-ahead that fits."""
    lo, hi = _need(PER_SHARD, 0), _need(PER_SHARD)
    assert lo < hi
    limit = lo + UNIT  # room for one shard ahead
    window, prefetch = _fit(limit)
    assert window == PER_SHARD and prefetch is not None
    assert _need(PER_SHARD, prefetch) <= limit < _need(PER_SHARD, prefetch + 1)


def test_a_limit_below_one_shards_window_is_refused_naming_the_least_that_works() -> None:
    """issue 22 item 3: refused only when not even one shard's window fits, naming the
    smallest limit that works; that limit then works."""
    least = _need(PER_SHARD, 0)
    with pytest.raises(ValueError, match=rf"cache_limit={least - 1:,} .* >= {least:,}"):
        _fit(least - 1)
    assert _fit(least) == (PER_SHARD, 0)


def test_a_window_or_read_ahead_the_user_chose_is_kept() -> None:
    """issue 22 item 3: an explicit shuffle_window is never changed (only the read-ahead
    shrinks); an explicit prefetch_shards is never changed (only the window shrinks)."""
    limit = SHARDS * UNIT // 4
    window, prefetch = _fit(limit, window=2000)
    assert window is None and prefetch is not None
    assert _need(2000, prefetch) <= limit < _need(2000, prefetch + 1)
    window, prefetch = _fit(limit, prefetch=2)
    assert window is not None and prefetch is None
    assert _need(window, 2) <= limit < _need(window + 1, 2)
    with pytest.raises(ValueError, match=r"window tried \(19,000 samples"):
        _fit(limit, window=19_000)
