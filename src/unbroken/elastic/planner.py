"""How often to checkpoint: Young's and Daly's intervals, and the goodput to expect.

With checkpoint cost ``C`` (seconds the job is blocked per save), mean time between failures
``M`` and restart cost ``R`` (detect + relaunch + load), all in seconds:

- Young (1974): ``T = sqrt(2 C M)``.
- Daly (2006), higher order: ``T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C``
  for ``C < 2M``, else ``T = M``.
- Expected wall time per unit of useful work for interval ``T`` (Daly's exponential-failure
  model): ``M e^(R/M) (e^((T+C)/M) - 1) / T``; goodput is its inverse.

Check values (Daly's paper, ``C`` = 5 min): ``T`` = 117, 57 and 9.1 min for ``M`` = 24 h, 6 h
and 15 min.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unbroken.elastic.recovery import phases

__all__ = [
    "Plan",
    "daly_interval",
    "estimate_from_events",
    "expected_goodput",
    "format_plan",
    "plan",
    "young_interval",
]


def _check(ckpt_cost: float, mtbf: float) -> None:
    if not ckpt_cost > 0:
        raise ValueError(f"checkpoint cost C={ckpt_cost} s must be > 0")
    if not mtbf > 0:
        raise ValueError(f"MTBF M={mtbf} s must be > 0")


def young_interval(ckpt_cost: float, mtbf: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M)`` (seconds)."""
    _check(ckpt_cost, mtbf)
    return math.sqrt(2.0 * ckpt_cost * mtbf)


def daly_interval(ckpt_cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum (seconds of compute between checkpoints)."""
    _check(ckpt_cost, mtbf)
    if ckpt_cost >= 2.0 * mtbf:
        return mtbf
    x = ckpt_cost / (2.0 * mtbf)
    return math.sqrt(2.0 * ckpt_cost * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - ckpt_cost


def expected_goodput(interval: float, ckpt_cost: float, mtbf: float,
                     restart_cost: float = 0.0) -> float:
    """Useful work / wall time for checkpointing every ``interval`` seconds of compute."""
    _check(ckpt_cost, mtbf)
    if interval <= 0 or restart_cost < 0:
        raise ValueError(
            f"interval={interval} s must be > 0 and restart_cost={restart_cost} s >= 0"
        )
    wall_per_work = mtbf * math.exp(restart_cost / mtbf) * math.expm1((interval + ckpt_cost) / mtbf)
    return interval / wall_per_work


@dataclass(frozen=True)
class Plan:
    ckpt_cost: float
    mtbf: float
    restart_cost: float
    young: float
    daly: float
    goodput_daly: float
    current: float | None = None
    goodput_current: float | None = None


def plan(ckpt_cost: float, mtbf: float, restart_cost: float = 0.0,
         current: float | None = None) -> Plan:
    """Both optimal intervals and the goodput of the current and of Daly's interval."""
    d = daly_interval(ckpt_cost, mtbf)
    return Plan(
        ckpt_cost, mtbf, restart_cost, young_interval(ckpt_cost, mtbf), d,
        expected_goodput(d, ckpt_cost, mtbf, restart_cost), current,
        None if current is None else expected_goodput(current, ckpt_cost, mtbf, restart_cost),
    )


def estimate_from_events(events: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """``C``, ``M``, ``R`` and the current interval measured in a run's ``events.jsonl``.

    ``C``: mean ``seconds`` of ``saved`` events; ``M``: wall time / failures; ``R``: mean
    detect + relaunch + load; current interval: mean time between ``saved`` events of one
    rank. A value the log cannot provide is None.
    """
    saved = [e for e in events if e["event"] == "saved"]
    costs = [float(e["seconds"]) for e in saved if e.get("seconds") is not None]
    ranks = {e.get("rank") for e in saved}
    rank = min(ranks, key=lambda r: (r is None, r or 0)) if ranks else None
    times = sorted(e["t"] for e in saved if e.get("rank") == rank)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > a]
    recs = phases(events)
    restart = [r.detect + r.relaunch + r.load for r in recs
               if r.relaunch is not None and r.load is not None]
    wall = (max(e["t"] for e in events) - min(e["t"] for e in events)) if events else 0.0
    return {
        "ckpt_cost": statistics.fmean(costs) if costs else None,
        "mtbf": wall / len(recs) if recs else None,
        "restart_cost": statistics.fmean(restart) if restart else None,
        "current": statistics.fmean(gaps) if gaps else None,
    }


def _dur(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def format_plan(p: Plan) -> str:
    lines = [
        f"checkpoint cost C = {_dur(p.ckpt_cost)}, MTBF M = {_dur(p.mtbf)}, "
        f"restart cost R = {_dur(p.restart_cost)}",
        f"Young interval  sqrt(2CM) = {_dur(p.young)}",
        f"Daly interval             = {_dur(p.daly)}   expected goodput {p.goodput_daly:.1%} "
        f"(wasted {1 - p.goodput_daly:.1%})",
    ]
    if p.current is not None and p.goodput_current is not None:
        lines.append(
            f"current interval          = {_dur(p.current)}   expected goodput "
            f"{p.goodput_current:.1%} (wasted {1 - p.goodput_current:.1%})"
        )
    return "\n".join(lines)
