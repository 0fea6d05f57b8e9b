"""The drill's PNG timeline: steps over wall time per drilled run, faults and recovery phases.

matplotlib is optional (``pip install 'unbroken[plot]'``): without it no PNG is written and
the report says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["plot_timeline"]

log = logging.getLogger(__name__)

_PHASES = (
    ("detect", "#d62728"),
    ("relaunch", "#ff7f0e"),
    ("load", "#bcbd22"),
    ("catch_up", "#2ca02c"),
)


def plot_timeline(path: str, panels: Sequence[dict[str, Any]]) -> str | None:
    """Write the PNG; returns None (and logs why) when matplotlib is missing.

    Each panel: ``title``, ``t0`` (Unix start), ``progress`` [(t, node, step)] sampled live
    (rolled-back work included), ``reference`` [(t, step)], ``faults`` [(t, label)] and
    ``recoveries`` (``Recovery.to_json()`` dicts plus ``t_detect``).
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, safe in threads
    except ImportError:
        log.warning("matplotlib is not installed: no timeline PNG (pip install 'unbroken[plot]')")
        return None
    fig = Figure(figsize=(11, 3.6 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)
    for ax, p in zip(axes[:, 0], panels, strict=True):
        t0 = float(p["t0"])
        ref = p.get("reference") or []
        if ref:
            ax.plot(
                [t - ref[0][0] + p.get("ref_offset", 0.0) for t, _ in ref],
                [s for _, s in ref],
                color="0.6",
                lw=1,
                ls="--",
                label="reference (shifted to the same first step)",
            )
        for node in sorted({n for _, n, _ in p["progress"]}):
            pts = [(t - t0, s) for t, n, s in p["progress"] if n == node]
            ax.plot(
                [x for x, _ in pts],
                [s for _, s in pts],
                ".",
                ms=2.5,
                label=f"node {node}: step (live)",
            )
        for name, color in _PHASES:
            for r in p.get("recoveries", []):
                start, width = _span(r, name)
                if start is not None and width is not None:
                    ax.axvspan(start - t0, start - t0 + width, color=color, alpha=0.25, lw=0)
            ax.plot([], [], color=color, lw=6, alpha=0.4, label=name.replace("_", "-"))
        for t, label in p.get("faults", []):
            ax.axvline(t - t0, color="k", lw=1)
            ax.annotate(
                label,
                (t - t0, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=8,
            )
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel("seconds since the supervisor started")
        ax.set_ylabel("step")
        ax.legend(loc="lower right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _span(r: dict[str, Any], name: str) -> tuple[float | None, float | None]:
    """Start time and length of one phase of a recovery record."""
    t = float(r["t_fail"])
    for phase, _ in _PHASES:
        width = r.get(phase)
        if width is None:
            return None, None
        if phase == name:
            return t, float(width)
        t += float(width)
    return None, None
