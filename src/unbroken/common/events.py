"""The run's event log: one JSON object per line in ``RUN_DIR/events.jsonl``.

Every process of a supervised run appends to it (``O_APPEND``, one ``write`` per line, so
lines from several processes never interleave on a local file system). The supervisor writes
its own events; workers call :func:`mark`, e.g. the checkpointer's
``mark("loaded", step=s, seconds=x)``. Both lifelines write here and the supervisor's recovery
phases (``unbroken.elastic.recovery``) are computed from it, so it lives in the neutral layer.

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
    loaded        step, seconds, tier: a rank restored a checkpoint (from the Checkpointer;
                  tier: memory, disk or archive)
    saved         step, seconds: a rank committed a checkpoint (optional)
    caught_up     step: local rank 0's beats reached the step reached before the last failure
    failure       attempt, t_fail, t_detect, kind, fault, action, reason, step, exit_code
    hang          attempt, ranks, stacks (dump files), t_detect
    stop          exit_code, reason
    finish        exit_code
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

__all__ = [
    "ENV_ATTEMPT",
    "ENV_CATCHUP",
    "ENV_RUN_DIR",
    "EVENTS_FILE",
    "PEER_FAILED_FILE",
    "EventTail",
    "append_event",
    "attempt_dir",
    "load_events",
    "mark",
    "peer_failed",
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
            log.warning(
                "cannot append to %s/%s: %s; recovery events are lost", run_dir, EVENTS_FILE, e
            )
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
