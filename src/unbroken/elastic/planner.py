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

Two tiers (issue 25): a memory tier costing ``c_m`` per publish covers a fraction ``f`` of
the failures (a process crash keeps its node's memory; a node loss needs the disk tier,
or a peer replica), the disk tier costing ``C`` covers the rest. First-order waste per
second ``c_m / T_m + C / T_d + (R + f T_m / 2 + (1 - f) T_d / 2) / M`` is least at
``T_m = sqrt(2 c_m M / f)`` and ``T_d = sqrt(2 C M / (1 - f))``: K and N are those
intervals in steps (:func:`memory_plan`).

``M`` measured from one run is only as good as the failures it saw: with ``k`` failures in
``T`` seconds, the 90% confidence interval of an exponential MTBF is
``[2T / chi2(0.95; 2k+2), 2T / chi2(0.05; 2k)]`` (time-terminated observation) — for one
failure, 0.21 T to 19 T. :func:`format_plan` warns when ``M`` rests on fewer than
:data:`MIN_FAILURES` failures or on less than :data:`MIN_WINDOW` seconds of running.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from unbroken.common.events import EVENTS_FILE, load_events
from unbroken.elastic.recovery import MEMBERSHIP, phases

__all__ = [
    "MIN_FAILURES",
    "MIN_WINDOW",
    "MemoryPlan",
    "Plan",
    "daly_interval",
    "estimate_from_events",
    "estimate_memory",
    "expected_goodput",
    "format_memory_plan",
    "format_plan",
    "memory_plan",
    "memory_plan_from_run",
    "mtbf_interval",
    "plan",
    "plan_from_run",
    "young_interval",
]

MIN_FAILURES = 10
"""Fewer failures than this leave a measured MTBF uncertain by more than about +-30%."""
MIN_WINDOW = 24 * 3600.0
"""Seconds of running below which a measured failure rate is not a long job's: failures
cluster (a bad node, a maintenance window), and a short run sees one cluster or none."""


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


def expected_goodput(
    interval: float, ckpt_cost: float, mtbf: float, restart_cost: float = 0.0
) -> float:
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
    failures: int | None = None
    """Failures ``mtbf`` was measured from (None: given, not measured)."""
    window: float | None = None
    """Seconds of running ``mtbf`` was measured over (None: given)."""


def plan(
    ckpt_cost: float,
    mtbf: float,
    restart_cost: float = 0.0,
    current: float | None = None,
    *,
    failures: int | None = None,
    window: float | None = None,
) -> Plan:
    """Both optimal intervals and the goodput of the current and of Daly's interval.
    ``failures``/``window``: the evidence behind a measured ``mtbf`` (for the warning)."""
    d = daly_interval(ckpt_cost, mtbf)
    return Plan(
        ckpt_cost,
        mtbf,
        restart_cost,
        young_interval(ckpt_cost, mtbf),
        d,
        expected_goodput(d, ckpt_cost, mtbf, restart_cost),
        current,
        None if current is None else expected_goodput(current, ckpt_cost, mtbf, restart_cost),
        failures,
        window,
    )


def estimate_from_events(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``C``, ``M``, ``R`` and the current interval measured in a run's ``events.jsonl``.

    ``ckpt_cost``: mean ``seconds`` of ``saved`` events; ``mtbf``: wall time / failures;
    ``restart_cost``: mean detect + relaunch + load; ``current``: mean time between
    ``saved`` events of one rank; ``failures`` and ``window`` (seconds): what ``mtbf`` rests
    on; ``saves``: saved events seen. A value the log cannot provide is None.
    """
    saved = [e for e in events if e["event"] == "saved"]
    costs = [float(e["seconds"]) for e in saved if e.get("seconds") is not None]
    ranks = {e.get("rank") for e in saved}
    rank = min(ranks, key=lambda r: (r is None, r or 0)) if ranks else None
    times = sorted(e["t"] for e in saved if e.get("rank") == rank)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > a]
    recs = [r for r in phases(events) if r.fault != MEMBERSHIP]  # a node joining is no failure
    restart = [
        r.detect + r.relaunch + r.load
        for r in recs
        if r.relaunch is not None and r.load is not None
    ]
    wall = (max(e["t"] for e in events) - min(e["t"] for e in events)) if events else 0.0
    return {
        "ckpt_cost": statistics.fmean(costs) if costs else None,
        "mtbf": wall / len(recs) if recs else None,
        "restart_cost": statistics.fmean(restart) if restart else None,
        "current": statistics.fmean(gaps) if gaps else None,
        "failures": len(recs),
        "window": wall,
        "saves": len(times),
    }


def plan_from_run(run_dir: str | None, given: Mapping[str, float | None]) -> Plan:
    """The plan from ``run_dir``'s events (if given), each value in ``given`` (``ckpt_cost``,
    ``mtbf``, ``restart_cost``, ``current``; None = measure) overriding the measured one.
    Raises ValueError saying what is missing and why."""
    got: dict[str, Any] = dict.fromkeys(("ckpt_cost", "mtbf", "restart_cost", "current"))
    why: dict[str, str] = {}
    if run_dir is not None:
        path = os.path.join(run_dir, EVENTS_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"--run-dir {run_dir!r} has no {EVENTS_FILE}: nothing to measure there. Pass "
                "the --run-dir of an `unbroken run` (it writes RUN_DIR/events.jsonl), or give "
                "--ckpt-cost and --mtbf"
            )
        got.update(estimate_from_events(load_events(run_dir)))
        if not got["saves"]:
            why["ckpt_cost"] = (
                f"{path} holds no checkpoint save (a Checkpointer under "
                "`unbroken run` records one per save)"
            )
        if not got["failures"]:
            why["mtbf"] = f"{path} holds no failure, so there is no failure rate to measure"
    for key, value in given.items():
        if value is not None:
            got[key] = value
            if key == "mtbf":
                got["failures"] = got["window"] = None  # given: no evidence to judge
    c, m = got["ckpt_cost"], got["mtbf"]
    if c is None or m is None:
        missing = [k for k, v in (("ckpt_cost", c), ("mtbf", m)) if v is None]
        need = " and ".join("--" + k.replace("_", "-") for k in missing)
        reasons = [why[k] for k in missing if k in why]
        raise ValueError(
            f"cannot plan without {need}: "
            + (
                "; ".join(reasons)
                if reasons
                else "pass them, or a --run-dir whose events hold saves and failures"
            )
        )
    return plan(
        c,
        m,
        got["restart_cost"] or 0.0,
        got["current"],
        failures=got.get("failures"),
        window=got.get("window"),
    )


def _chi2_even_cdf(x: float, dof: int) -> float:
    """CDF of chi-square with an even ``dof``: a Gamma(dof/2, 2), i.e. 1 - Poisson tail."""
    k, lam = dof // 2, x / 2.0
    term, total = 1.0, 1.0
    for i in range(1, k):
        term *= lam / i
        total += term
    return 1.0 - math.exp(-lam) * total


def _chi2_even_ppf(p: float, dof: int) -> float:
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(200):  # bisection: the CDF is monotone
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _chi2_even_cdf(mid, dof) < p else (lo, mid)
    return (lo + hi) / 2


def mtbf_interval(failures: int, window: float, confidence: float = 0.9) -> tuple[float, float]:
    """Two-sided confidence interval of the MTBF after ``failures`` failures in ``window``
    seconds (exponential failures, observation ended by time)."""
    if failures < 1 or window <= 0:
        raise ValueError(f"failures={failures} must be >= 1 and window={window} s > 0")
    a = (1.0 - confidence) / 2.0
    return (
        2.0 * window / _chi2_even_ppf(1.0 - a, 2 * failures + 2),
        2.0 * window / _chi2_even_ppf(a, 2 * failures),
    )


def _dur(s: float) -> str:
    """Seconds in a unit that keeps the value readable: 7 ms is not "0.0 s"."""
    a = abs(s)
    if a >= 3600:
        return f"{s / 3600:.2f} h"
    if a >= 60:
        return f"{s / 60:.1f} min"
    if a >= 10 or a == 0:
        return f"{s:.1f} s"
    if a >= 1:
        return f"{s:.2f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _mtbf_warning(p: Plan) -> str | None:
    k, w = p.failures, p.window
    if k is None or w is None or (k >= MIN_FAILURES and w >= MIN_WINDOW):
        return None
    lo, hi = mtbf_interval(k, w) if k >= 1 and w > 0 else (math.nan, math.nan)
    weak = []
    if k < MIN_FAILURES:
        weak.append(f"fewer than {MIN_FAILURES} failures")
    if w < MIN_WINDOW:
        weak.append("less than a day of running")
    return (
        f"warning: M = {_dur(p.mtbf)} rests on {k} failure{'s' if k != 1 else ''} in "
        f"{_dur(w)} ({' and '.join(weak)}): its 90% confidence interval is {_dur(lo)} to "
        f"{_dur(hi)}, so the intervals above are only a guess. Pass --mtbf with a rate "
        "measured over many failures (e.g. your cluster's history); a drill's injected "
        "faults are not a failure rate."
    )


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
    warn = _mtbf_warning(p)
    if warn:
        lines.append(warn)
    return "\n".join(lines)


# --- two tiers: memory every K steps, disk every N (issue 25) ---------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    memory_cost: float
    disk_cost: float
    mtbf: float
    step_time: float
    memory_fraction: float
    restart_cost: float
    every_k: int
    """Publish to the memory tier every K steps."""
    every_n: int
    """Save to the disk tier every N steps (a multiple of K)."""
    goodput: float
    """First-order goodput with both tiers at K and N."""
    goodput_disk_only: float
    """First-order goodput with the disk tier alone at Young's interval."""
    memory_bytes: int | None = None
    """What the memory tier holds per rank (two slots), when measured; with the peer
    replica (several nodes) each rank also keeps one peer's slot: 1.5x that."""


def _waste(c_m: float, t_m: float, c: float, t_d: float, f: float, m: float, r: float) -> float:
    return c_m / t_m + c / t_d + (r + f * t_m / 2 + (1 - f) * t_d / 2) / m


def memory_plan(
    *,
    memory_cost: float,
    disk_cost: float,
    mtbf: float,
    step_time: float,
    memory_fraction: float,
    restart_cost: float = 0.0,
    memory_bytes: int | None = None,
) -> MemoryPlan:
    """K and N (steps) from the first-order two-level optimum (module doc), and the
    goodput they buy against the disk tier alone."""
    _check(disk_cost, mtbf)
    f = memory_fraction
    if not (memory_cost > 0 and step_time > 0 and 0 <= f < 1 and restart_cost >= 0):
        raise ValueError(
            f"memory_cost={memory_cost} s and step_time={step_time} s must be > 0, "
            f"memory_fraction={f} in [0, 1) (the disk tier must cover some failures) and "
            f"restart_cost={restart_cost} s >= 0"
        )
    t_m = math.sqrt(2 * memory_cost * mtbf / f) if f > 0 else math.inf
    t_d = math.sqrt(2 * disk_cost * mtbf / (1 - f))
    n_raw = max(1, round(t_d / step_time))
    k = max(1, min(round(t_m / step_time), n_raw)) if math.isfinite(t_m) else n_raw
    n = max(k, round(n_raw / k) * k)
    r = restart_cost
    two = _waste(memory_cost, k * step_time, disk_cost, n * step_time, f, mtbf, r)
    if k == n:  # the memory tier adds nothing a disk save does not already give
        two = _waste(0.0, 1.0, disk_cost, n * step_time, 0.0, mtbf, r)
    young = math.sqrt(2 * disk_cost * mtbf)
    one = _waste(0.0, 1.0, disk_cost, young, 0.0, mtbf, r)
    return MemoryPlan(
        memory_cost, disk_cost, mtbf, step_time, f, r, k, n,
        max(0.0, 1 - two), max(0.0, 1 - one), memory_bytes,
    )  # fmt: skip


def estimate_memory(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The memory tier as a run's ``events.jsonl`` saw it: ``memory_cost`` (mean loop stall
    of a publish, from the ``saved`` events' ``memory_seconds``), ``memory_bytes`` (the
    slots of one rank), ``step_time`` (seconds per step between ``saved`` events of one
    rank) and ``memory_fraction`` (the share of restarts restored from memory; None when
    no restart was seen). A value the log cannot provide is None."""
    saved = [e for e in events if e["event"] == "saved" and isinstance(e.get("step"), int)]
    costs = [float(e["memory_seconds"]) for e in saved if e.get("memory_seconds") is not None]
    sizes = [int(e["memory_bytes"]) for e in saved if isinstance(e.get("memory_bytes"), int)]
    rank = min((e.get("rank") or 0 for e in saved), default=0)
    mine = sorted((e["step"], e["t"]) for e in saved if (e.get("rank") or 0) == rank)
    rates = [
        (t2 - t1) / (s2 - s1)
        for (s1, t1), (s2, t2) in zip(mine, mine[1:], strict=False)
        if s2 > s1 and t2 > t1
    ]
    tiers = [r.tier for r in phases(events) if r.tier is not None]
    return {
        "memory_cost": statistics.fmean(costs) if costs else None,
        "memory_bytes": max(sizes) if sizes else None,
        "step_time": statistics.median(rates) if rates else None,
        "memory_fraction": tiers.count("memory") / len(tiers) if tiers else None,
    }


def _bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def format_memory_plan(p: MemoryPlan) -> str:
    held = (
        f"; it holds {_bytes(p.memory_bytes)} per rank (2 slots), "
        f"{_bytes(p.memory_bytes * 3 // 2)} per rank with the peer replica (3x the per-rank "
        "state)"
        if p.memory_bytes
        else ""
    )
    return "\n".join(
        [
            f"memory tier: cost c_m = {_dur(p.memory_cost)} per publish, covers "
            f"{p.memory_fraction:.0%} of the failures, step {_dur(p.step_time)}{held}",
            f"suggested: memory every K = {p.every_k} steps, disk every N = {p.every_n} "
            f"steps   expected goodput {p.goodput:.1%} (disk alone at Young's interval: "
            f"{p.goodput_disk_only:.1%}; first-order model)",
        ]
    )


def memory_plan_from_run(
    run_dir: str | None, given: Mapping[str, float | None], disk: Plan
) -> MemoryPlan | None:
    """The two-tier plan when the memory tier's cost is known (``given["memory_cost"]`` or
    measured in ``run_dir``), each of ``memory_cost``, ``step_time``, ``memory_fraction``
    in ``given`` overriding the measured one; None when the run had no memory tier and no
    cost was given. Raises ValueError naming what is missing."""
    got: dict[str, Any] = dict.fromkeys(
        ("memory_cost", "memory_bytes", "step_time", "memory_fraction")
    )
    if run_dir is not None:
        got.update(estimate_memory(load_events(run_dir)))
    got.update({k: v for k, v in given.items() if v is not None})
    if got["memory_cost"] is None:
        return None
    missing = [k for k in ("step_time", "memory_fraction") if got[k] is None]
    if missing:
        raise ValueError(
            "cannot plan the memory tier without "
            + " and ".join("--" + k.replace("_", "-") for k in missing)
            + ": the run shows no step time (two disk saves) or no restart that says its "
            "tier; pass them (--memory-fraction: the share of failures that keep their node, "
            "e.g. 0.9 when most failures are process crashes)"
        )
    return memory_plan(
        memory_cost=float(got["memory_cost"]),
        disk_cost=disk.ckpt_cost,
        mtbf=disk.mtbf,
        step_time=float(got["step_time"]),
        memory_fraction=min(float(got["memory_fraction"]), 0.99),
        restart_cost=disk.restart_cost,
        memory_bytes=got["memory_bytes"],
    )
