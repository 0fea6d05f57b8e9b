"""The four recovery phases of a supervised run, computed from its event log (E-MEASURED).

The event log and its schema: :mod:`unbroken.common.events`.

Phases of failure *i* (attempt ``a`` failed, attempt ``a+1`` recovers):

    detect    t_detect - t_fail              failure -> supervisor knows (a worker seen
                                             dead, torchrun exited, or the hang timeout)
    relaunch  workers_up(a+1) - t_detect     classify, back off, pre-flight, torchrun, rendezvous
    load      loaded(a+1) - workers_up(a+1)  interpreter, imports, process group, restore
    catch_up  caught_up(a+1) - loaded(a+1)   recompute the steps lost since the checkpoint

When attempt ``a+1`` restored nothing (no ``loaded``: the failure came before the first
checkpoint, or the job does not mark its restores), load is 0 and catch-up runs from
``workers_up(a+1)``: its start-up is then part of recomputing the steps from the first.

``loaded``/``caught_up`` of several ranks: the slowest rank ends the phase. Each record
also names the tier the restart restored from (``loaded``'s ``tier``: memory, disk,
archive) and the steps lost (the step reached before the failure less the step restored).

A membership change (torchrun restarting the workers of a running attempt to admit a
joining node, the supervisor's ``membership`` event) is no failure, but it costs the same
phases, so it has a line of its own (fault :data:`MEMBERSHIP`) in the same attempt:

    detect    t_detect - t_fail              torchrun stopped the workers -> supervisor saw it
    relaunch  t_up - t_detect                -> the new workers appeared
    load      loaded(after t_fail) - t_up    restore (the slowest rank)
    catch_up  membership_caught_up - loaded  back at the step reached before the stop
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.common.tables import cell, render_table
from unbroken.common.text import printable

__all__ = [
    "MEMBERSHIP",
    "Recovery",
    "RunSummary",
    "format_summary",
    "phases",
    "plot_timeline",
    "summarize",
]

log = logging.getLogger(__name__)

MEMBERSHIP = "membership"
"""The ``fault`` of a record that is a membership change (a node joined), not a failure."""


@dataclass(frozen=True)
class Recovery:
    """One failure and the time it cost, phase by phase (seconds; None = not reached)."""

    index: int
    attempt: int
    fault: str
    reason: str
    step_at_failure: int | None
    t_fail: float
    detect: float
    relaunch: float | None
    load: float | None
    catch_up: float | None
    restore_seconds: float | None
    """What the checkpointer itself reported for the restore (part of ``load``)."""
    loaded_step: int | None
    tier: str | None = None
    """Which checkpoint tier the restart restored from (``memory``, ``disk``, ``archive``:
    the ``loaded`` event's; None when the job did not say)."""
    steps_lost: int | None = None
    """Steps recomputed: the step reached before the failure less the step restored."""

    @property
    def total(self) -> float | None:
        parts = (self.detect, self.relaunch, self.load, self.catch_up)
        return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        return d


def _first(events: Iterable[dict[str, Any]], name: str, attempt: int) -> dict[str, Any] | None:
    for e in events:
        if e["event"] == name and e.get("attempt") == attempt:
            return e
    return None


def _last_of(events: Sequence[dict[str, Any]], name: str, attempt: int) -> dict[str, Any] | None:
    """The slowest rank's *first* event of this name in the attempt: the phase ends when
    every rank got there (later repeats, e.g. after a spare joined, do not count)."""
    first: dict[Any, dict[str, Any]] = {}
    for e in events:
        if e["event"] == name and e.get("attempt") == attempt:
            first.setdefault(e.get("rank"), e)
    return max(first.values(), key=lambda e: e["t"]) if first else None


def _membership_marks(
    events: Sequence[dict[str, Any]], m: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
    """(workers up, loaded, caught up) of the membership change ``m``: the new workers'
    first events of its attempt after the stop (a ``workers_up``-like mark of ``t_up``)."""
    attempt, t_fail = int(m["attempt"]), float(m["t_fail"])
    after = [e for e in events if e.get("attempt") == attempt and e["t"] > t_fail]
    up = {"t": float(m["t_up"])} if m.get("t_up") is not None else None
    return up, _last_of(after, "loaded", attempt), _first(after, "membership_caught_up", attempt)


def phases(events: Sequence[dict[str, Any]]) -> list[Recovery]:
    """Per-failure (and per membership change) recovery phases from a run's raw events, in
    the order they happened (pure; see the module doc)."""
    out: list[Recovery] = []
    records = [e for e in events if e["event"] in ("failure", "membership")]
    for i, f in enumerate(sorted(records, key=lambda e: float(e["t_fail"]))):
        if f["event"] == "membership":
            up, loaded, caught = _membership_marks(events, f)
        else:
            nxt = int(f["attempt"]) + 1
            up = _first(events, "workers_up", nxt)
            loaded = _last_of(events, "loaded", nxt)
            caught = _last_of(events, "caught_up", nxt)
        t_detect = float(f["t_detect"])
        relaunch = up["t"] - t_detect if up else None
        load = max(0.0, loaded["t"] - up["t"]) if (loaded and up) else None
        catch_up: float | None = None
        if loaded and caught:
            catch_up = max(0.0, caught["t"] - loaded["t"])
        elif up and caught:  # nothing restored (a fresh start): every step is recomputed
            load, catch_up = 0.0, max(0.0, caught["t"] - up["t"])
        elif (
            loaded
            and f.get("step") is not None
            and loaded.get("step") is not None
            and int(loaded["step"]) >= int(f["step"])
        ):
            catch_up = 0.0  # the checkpoint already held the step reached before the failure
        restore = loaded.get("seconds") if loaded else None
        loaded_step = int(loaded["step"]) if loaded and loaded.get("step") is not None else None
        tier = loaded.get("tier") if loaded else None
        lost = (
            max(0, int(f["step"]) - loaded_step)
            if loaded_step is not None and f.get("step") is not None
            else None
        )
        out.append(
            Recovery(
                index=i,
                attempt=int(f["attempt"]),
                fault=MEMBERSHIP if f["event"] == "membership" else str(f.get("fault", "?")),
                reason=str(f.get("reason", "")),
                step_at_failure=f.get("step"),
                t_fail=float(f["t_fail"]),
                detect=max(0.0, t_detect - float(f["t_fail"])),
                relaunch=relaunch,
                load=load,
                catch_up=catch_up,
                restore_seconds=float(restore) if restore is not None else None,
                loaded_step=loaded_step,
                tier=str(tier) if tier is not None else None,
                steps_lost=lost,
            )
        )
    return out


@dataclass(frozen=True)
class RunSummary:
    wall: float
    lost: float
    """Startup (first launch -> first worker ready) plus every recovery's phases."""
    recoveries: list[Recovery]
    trend_warning: str | None

    @property
    def goodput(self) -> float:
        return 0.0 if self.wall <= 0 else max(0.0, 1.0 - self.lost / self.wall)


def summarize(events: Sequence[dict[str, Any]], now: float | None = None) -> RunSummary:
    """Wall time, time lost to startup and recoveries, goodput and a slow-down warning."""
    if not events:
        return RunSummary(0.0, 0.0, [], None)
    t0 = min(e["t"] for e in events)
    ends = [e["t"] for e in events if e["event"] in ("finish", "stop")]
    t1 = max(ends) if ends else (now if now is not None else max(e["t"] for e in events))
    recs = phases(events)
    lost = 0.0
    first_attempt = min((int(e["attempt"]) for e in events if e["event"] == "launch"), default=0)
    ready = _last_of(events, "loaded", first_attempt) or _first(events, "workers_up", first_attempt)
    if ready:
        lost += ready["t"] - t0
    for r in recs:
        lost += sum(p for p in (r.detect, r.relaunch, r.load, r.catch_up) if p is not None)
    return RunSummary(t1 - t0, min(lost, t1 - t0), recs, _trend(recs))


def _trend(recs: Sequence[Recovery]) -> str | None:
    totals = [r.total for r in recs if r.total is not None]
    if len(totals) < 3:
        return None
    base = statistics.median(totals[:-1])
    if base > 0 and totals[-1] > 1.5 * base:
        return (
            f"recoveries are getting slower: the last took {totals[-1]:.1f} s, "
            f"{totals[-1] / base:.1f}x the median {base:.1f} s of the earlier ones"
        )
    return None


def format_summary(summary: RunSummary) -> str:
    """A plain-text table, one row per failure, then totals and goodput."""
    rows = [
        (
            r.index,
            r.attempt,
            printable(r.fault),  # the event log is a file: its text is escaped (common.text)
            r.step_at_failure,
            printable(r.tier or "-"),
            cell(r.steps_lost, "d"),
            *(cell(x, ".2f") for x in (r.detect, r.relaunch, r.load, r.catch_up, r.total)),
            printable(r.reason)[:60],
        )
        for r in summary.recoveries
    ]
    header = (
        "#",
        "attempt",
        "fault",
        "step",
        "tier",
        "lost",
        "detect",
        "relaunch",
        "load",
        "catch-up",
        "total",
        "reason",
    )
    lines = [
        "recovery phases (seconds):",
        render_table(rows, header=header, right={0, 1, 3, 5, 6, 7, 8, 9, 10}),
    ]
    if not summary.recoveries:
        lines.append("   (no failures)")
    lines.append(
        f"wall {summary.wall:.1f} s, lost to startup and recovery {summary.lost:.1f} s, "
        f"goodput {summary.goodput:.1%}"
    )
    if summary.trend_warning:
        lines.append("WARNING: " + summary.trend_warning)
    return "\n".join(lines)


_PHASE_COLORS = (
    ("detect", "#d62728"),
    ("relaunch", "#ff7f0e"),
    ("load", "#bcbd22"),
    ("catch_up", "#9467bd"),
)


def plot_timeline(events: Sequence[dict[str, Any]], path: str) -> str:
    """Write a PNG timeline: one row per attempt (running), the recovery phases of every
    failure in colour, checkpoint saves as ticks. Needs matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("plot_timeline needs matplotlib: pip install 'unbroken[plot]'") from err
    if not events:
        raise ValueError("no events to plot: is this a run directory of `unbroken run`?")
    t0 = min(e["t"] for e in events)
    launches = [e for e in events if e["event"] == "launch"]
    ends = {int(e["attempt"]): float(e["t_detect"]) for e in events if e["event"] == "failure"}
    t_end = max(e["t"] for e in events)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.4 * len(launches)))
    for row, e in enumerate(launches):
        a = int(e["attempt"])
        ax.broken_barh(
            [(e["t"] - t0, ends.get(a, t_end) - e["t"])],
            (row - 0.3, 0.6),
            color="#2ca02c",
            alpha=0.35,
        )
        saves = [s["t"] - t0 for s in events if s["event"] == "saved" and s.get("attempt") == a]
        ax.plot(saves, [row] * len(saves), "|", color="black", markersize=8)
    for r in phases(events):
        start = r.t_fail - t0
        for name, color in _PHASE_COLORS:
            dur = getattr(r, name)
            if dur is None:
                break
            ax.broken_barh(
                [(start, dur)],
                (-0.5, len(launches)),
                color=color,
                alpha=0.5,
                label=name if r.index == 0 else None,
            )
            start += dur
    ax.set_yticks(range(len(launches)), [f"attempt {e['attempt']}" for e in launches])
    ax.set_xlabel("seconds since start")
    ax.set_title(f"goodput {summarize(events).goodput:.1%}")
    if any(True for _ in phases(events)):
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
