"""The run's event log and the four recovery phases computed from it (E-MEASURED).

Every process of a supervised run appends one JSON object per line to
``RUN_DIR/events.jsonl`` (``O_APPEND``, one ``write`` per line, so lines from several
processes never interleave on a local file system). The supervisor writes its own events;
workers call :func:`mark`, e.g. the checkpointer's ``mark("loaded", step=s, seconds=x)``.

Event schema (common keys ``t`` = Unix time, ``event``, ``attempt``, ``pid``, ``rank``)::

    start         supervisor started (config)
    preflight     ok, seconds, checks: [{name, ok, detail}]
    standby       attempt, seconds, preload, failed, fork_server: a pre-warmed agent for the
                  attempt finished its imports (``seconds``: what a restart no longer pays)
    launch        attempt, gen, agent_pid, prewarmed: a torchrun agent was started
    workers_up    attempt, pids: the first worker processes of the attempt exist
    worker_exit   attempt, rank, local_rank, worker_pid, exitcode (negative: signal; null:
                  unknown), stopped (asked to stop first), via (zygote|spawn): one rank
                  ended (written by its launcher, see ``_launch``)
    stop_group    attempt, reason, grace, seconds, exited, killed: a rank failed, so the
                  supervisor stopped the others (``exited`` ranks left within ``grace``
                  seconds, ``killed`` ones were SIGKILLed) and relaunches
    loaded        step, seconds: a rank restored a checkpoint (from the Checkpointer)
    saved         step, seconds: a rank committed a checkpoint (optional)
    caught_up     step: local rank 0's beats reached the step reached before the last failure
    failure       attempt, t_fail, t_detect, kind, fault, action, reason, step, exit_code
    hang          attempt, ranks, stacks (dump files), t_detect
    stop          exit_code, reason
    finish        exit_code

Phases of failure *i* (attempt ``a`` failed, attempt ``a+1`` recovers):

    detect    t_detect - t_fail              failure -> supervisor knows (a worker seen
                                             dead, torchrun exited, or the hang timeout)
    relaunch  workers_up(a+1) - t_detect     classify, back off, pre-flight, torchrun, rendezvous
    load      loaded(a+1) - workers_up(a+1)  interpreter, imports, process group, restore
    catch_up  caught_up(a+1) - loaded(a+1)   recompute the steps lost since the checkpoint

``loaded``/``caught_up`` of several ranks: the slowest rank ends the phase.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "ENV_ATTEMPT",
    "ENV_CATCHUP",
    "ENV_RUN_DIR",
    "EVENTS_FILE",
    "PEER_FAILED_FILE",
    "EventTail",
    "Recovery",
    "RunSummary",
    "append_event",
    "attempt_dir",
    "format_summary",
    "load_events",
    "mark",
    "peer_failed",
    "phases",
    "plot_timeline",
    "summarize",
]

log = logging.getLogger(__name__)

ENV_RUN_DIR = "UNBROKEN_RUN_DIR"
"""Set by the supervisor for every worker: the run directory. Unset means 'not supervised'."""
ENV_ATTEMPT = "UNBROKEN_ATTEMPT"
"""The attempt number (0, 1, ...) of the torchrun agent that started this worker."""
ENV_CATCHUP = "UNBROKEN_CATCHUP_STEP"
"""The highest step reached before the last failure; beats at or past it end catch-up."""
EVENTS_FILE = "events.jsonl"
PEER_FAILED_FILE = "peer_failed"
"""Written into the attempt's directory (one line: why) before the supervisor stops the
ranks that outlived a failed one; see :func:`peer_failed`."""
_RESERVED = frozenset({"t", "event", "attempt", "pid"})
_warned = False


def append_event(run_dir: str, record: dict[str, Any]) -> None:
    """Append one JSON line to ``run_dir/events.jsonl`` with a single ``write``."""
    line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
    fd = os.open(os.path.join(run_dir, EVENTS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def mark(event: str, **fields: Any) -> None:
    """Record a phase event for the supervisor; a no-op when not run under ``unbroken run``.

    Example: ``mark("loaded", step=1200, seconds=3.4)`` after a checkpoint restore. Never
    raises for I/O errors (a logging problem must not stop training); logs one warning.
    """
    global _warned
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return
    bad = _RESERVED.intersection(fields)
    if bad:
        raise ValueError(f"mark({event!r}): field names {sorted(bad)} are reserved; rename them")
    record: dict[str, Any] = {
        "t": time.time(),
        "event": event,
        "attempt": _int_env(ENV_ATTEMPT),
        "pid": os.getpid(),
        "rank": _int_env("RANK"),
    }
    record.update(fields)
    try:
        append_event(run_dir, record)
    except OSError as e:
        if not _warned:
            log.warning("cannot append to %s/%s: %s; recovery events are lost", run_dir, EVENTS_FILE, e)
            _warned = True


def attempt_dir(run_dir: str, attempt: int) -> str:
    """``RUN_DIR/attempts/<n>``: logs, torchrun's log dir and markers of one attempt."""
    return os.path.join(run_dir, "attempts", str(attempt))


def peer_failed() -> str | None:
    """Why this worker's group is being stopped, if a rank of it failed; else None.

    When one rank dies, the others cannot finish a collective with it, so a save on SIGTERM
    would only hang until the supervisor's SIGKILL. A SIGTERM handler calls this first and
    exits at once when it returns a reason (the Checkpointer's ``save_on_sigterm`` does).
    One ``open`` call; None when not run under ``unbroken run``.
    """
    run_dir = os.environ.get(ENV_RUN_DIR)
    attempt = _int_env(ENV_ATTEMPT)
    if not run_dir or attempt is None:
        return None
    try:
        with open(os.path.join(attempt_dir(run_dir, attempt), PEER_FAILED_FILE), "rb") as f:
            return f.read().decode("utf-8", "replace").strip() or "a peer rank failed"
    except OSError:
        return None


def _int_env(name: str) -> int | None:
    v = os.environ.get(name)
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def load_events(run_dir: str) -> list[dict[str, Any]]:
    """All events of a run in file order; a torn last line (writer killed) is skipped."""
    path = os.path.join(run_dir, EVENTS_FILE)
    out: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and "event" in rec and "t" in rec:
                    out.append(rec)
    except FileNotFoundError:
        return []
    return out


class EventTail:
    """Reads only the events appended since the last :meth:`read` (the supervisor polls this
    several times a second; re-reading the whole log each time would grow with the run)."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, EVENTS_FILE)
        try:
            self._offset = os.path.getsize(self.path)
        except OSError:
            self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "event" in rec:
                out.append(rec)
        return out


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


def phases(events: Sequence[dict[str, Any]]) -> list[Recovery]:
    """Per-failure recovery phases from a run's raw events (pure; see the module doc)."""
    out: list[Recovery] = []
    failures = [e for e in events if e["event"] == "failure"]
    for i, f in enumerate(failures):
        nxt = int(f["attempt"]) + 1
        up = _first(events, "workers_up", nxt)
        loaded = _last_of(events, "loaded", nxt)
        caught = _last_of(events, "caught_up", nxt)
        t_detect = float(f["t_detect"])
        relaunch = up["t"] - t_detect if up else None
        load = loaded["t"] - up["t"] if (loaded and up) else None
        catch_up: float | None = None
        if loaded and caught:
            catch_up = max(0.0, caught["t"] - loaded["t"])
        elif loaded and f.get("step") is not None and loaded.get("step") is not None:
            if int(loaded["step"]) >= int(f["step"]):
                catch_up = 0.0  # the checkpoint already held the step reached before the failure
        restore = loaded.get("seconds") if loaded else None
        out.append(
            Recovery(
                index=i,
                attempt=int(f["attempt"]),
                fault=str(f.get("fault", "?")),
                reason=str(f.get("reason", "")),
                step_at_failure=f.get("step"),
                t_fail=float(f["t_fail"]),
                detect=max(0.0, t_detect - float(f["t_fail"])),
                relaunch=relaunch,
                load=load,
                catch_up=catch_up,
                restore_seconds=float(restore) if restore is not None else None,
                loaded_step=int(loaded["step"]) if loaded and loaded.get("step") is not None else None,
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


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_summary(summary: RunSummary) -> str:
    """A plain-text table, one row per failure, then totals and goodput."""
    head = f"{'#':>2} {'attempt':>7} {'fault':<13} {'step':>6} {'detect':>7} {'relaunch':>8} " \
           f"{'load':>7} {'catch-up':>8} {'total':>7}  reason"
    lines = ["recovery phases (seconds):", head]
    for r in summary.recoveries:
        lines.append(
            f"{r.index:>2} {r.attempt:>7} {r.fault:<13} {str(r.step_at_failure):>6} "
            f"{_fmt(r.detect):>7} {_fmt(r.relaunch):>8} {_fmt(r.load):>7} "
            f"{_fmt(r.catch_up):>8} {_fmt(r.total):>7}  {r.reason[:60]}"
        )
    if not summary.recoveries:
        lines.append("   (no failures)")
    lines.append(
        f"wall {summary.wall:.1f} s, lost to startup and recovery {summary.lost:.1f} s, "
        f"goodput {summary.goodput:.1%}"
    )
    if summary.trend_warning:
        lines.append("WARNING: " + summary.trend_warning)
    return "\n".join(lines)


_PHASE_COLORS = (("detect", "#d62728"), ("relaunch", "#ff7f0e"), ("load", "#bcbd22"),
                 ("catch_up", "#9467bd"))


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
        ax.broken_barh([(e["t"] - t0, ends.get(a, t_end) - e["t"])], (row - 0.3, 0.6),
                       color="#2ca02c", alpha=0.35)
        saves = [s["t"] - t0 for s in events if s["event"] == "saved" and s.get("attempt") == a]
        ax.plot(saves, [row] * len(saves), "|", color="black", markersize=8)
    for r in phases(events):
        start = r.t_fail - t0
        for name, color in _PHASE_COLORS:
            dur = getattr(r, name)
            if dur is None:
                break
            ax.broken_barh([(start, dur)], (-0.5, len(launches)), color=color, alpha=0.5,
                           label=name if r.index == 0 else None)
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
