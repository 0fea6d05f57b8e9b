"""numpy helpers for ragged data (many variable-length pieces in one flat array)."""

from __future__ import annotations

import numpy as np

__all__ = ["concat_ranges"]


def concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for each ``(s, n)``, without a Python loop: the flat
    positions of many variable-length pieces (gather or scatter them in one numpy step)."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
