"""The run's event log: one JSON object per line in ``RUN_DIR/events.jsonl``.

Every process of a supervised run appends to it (``O_APPEND``, one ``write`` per line, so
lines from several processes never interleave on a local file system): the supervisor its
own events, workers through :func:`mark` (e.g. ``mark("loaded", step=s, seconds=x)``).
The recovery phases (:mod:`unbroken.elastic.recovery`, E-MEASURED) are computed from it,
so both lifelines write here and it lives in the neutral layer.

The run directory is private to the job's user (:func:`unbroken.common.fs.private_dir`,
T-SHARED-NODE): files 0600 (:data:`FILE_MODE`), directories 0700
(:func:`private_subdir`), every fixed name opened without following a symlink.

The event schema (start, preflight, standby, launch, agent_idle, workers_up, worker_exit,
stop_group, loaded, restore_refused, saved, caught_up, failure, membership,
membership_caught_up, hang, stop, finish):
ARCHITECTURE.md, "Design notes" > common > the event log.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from unbroken.common.fs import open_private, private_dir

__all__ = [
    "ENV_ATTEMPT",
    "ENV_CATCHUP",
    "ENV_RUN_DIR",
    "EVENTS_FILE",
    "FILE_MODE",
    "PEER_FAILED_FILE",
    "EventTail",
    "append_event",
    "attempt_dir",
    "load_events",
    "mark",
    "peer_failed",
    "private_subdir",
]

log = logging.getLogger(__name__)

ENV_RUN_DIR = "UNBROKEN_RUN_DIR"
"""Set by the supervisor for every worker: the run directory. Unset means 'not supervised'."""
ENV_ATTEMPT = "UNBROKEN_ATTEMPT"
"""The attempt number (0, 1, ...) of the torchrun agent that started this worker."""
ENV_CATCHUP = "UNBROKEN_CATCHUP_STEP"
"""The highest step reached before the last failure; beats at or past it end catch-up."""
ENV_SUPERVISOR = "UNBROKEN_SUPERVISOR_PID"
"""The pid of the ``unbroken run`` that started this agent: it ends with that process."""
EVENTS_FILE = "events.jsonl"
PEER_FAILED_FILE = "peer_failed"
"""Written into the attempt's directory (one line: why) before the supervisor stops the
ranks that outlived a failed one; see :func:`peer_failed`."""
FILE_MODE = 0o600
"""Mode of every file in a run directory (events, logs, beacons, reports)."""
_RESERVED = frozenset({"t", "event", "attempt", "pid"})
_warned = False


def append_event(run_dir: str, record: dict[str, Any]) -> None:
    """Append one JSON line to ``run_dir/events.jsonl`` with a single ``write``."""
    line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
    fd = open_private(os.path.join(run_dir, EVENTS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
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


def private_subdir(run_dir: str, *parts: str) -> str:
    """``RUN_DIR/part/part/...``, each level created 0700 or checked private (``makedirs``
    would create the levels above the last with the umask's mode)."""
    path = run_dir
    for part in parts:
        path = private_dir(os.path.join(path, part), purpose="run directory")
    return path


def _read_fixed(path: str) -> bytes:
    """A fixed name's bytes: a regular file of this user's, never through a symlink, never
    blocking on a FIFO (:func:`.open_private`; each refusal an ``OSError`` naming the path)."""
    with os.fdopen(open_private(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        return f.read()


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
        data = _read_fixed(os.path.join(attempt_dir(run_dir, attempt), PEER_FAILED_FILE))
    except OSError:
        return None
    return data[:4096].decode("utf-8", "replace").strip() or "a peer rank failed"


def _int_env(name: str) -> int | None:
    v = os.environ.get(name)
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def load_events(run_dir: str) -> list[dict[str, Any]]:
    """All events of a run in file order; a torn last line (writer killed) is skipped."""
    try:
        data = _read_fixed(os.path.join(run_dir, EVENTS_FILE))
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "event" in rec and "t" in rec:
            out.append(rec)
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
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return []
        with os.fdopen(fd, "rb") as f:
            f.seek(self._offset)
            data = f.read()
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
