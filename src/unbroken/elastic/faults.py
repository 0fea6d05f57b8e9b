"""Classify a failed attempt and decide what to do about it (E-CLASSIFY), plus the restart
policy (budget, exponential backoff, no-progress guard, deterministic-bug stop).

:func:`classify` takes the :class:`Evidence` of an attempt (the launchers' ``worker_exit``
events, torchrun's failure summary, the ``@record`` error files, the tail of each rank's
stderr), finds the primary (non-collateral) failure and matches it against one ordered
table, :data:`DEFAULT_RULES` (the first match wins; extend it with ``rules=[Rule(...),
*DEFAULT_RULES]`` or ``unbroken run --fault-rule storage=REGEX``). Fault -> action:

* ``process`` -> restart: CUDA error, OOM, collective timeout, segfault, SIGKILL, hang, any
  other exception (first time);
* ``node_lost`` -> wait_for_nodes: agent gone or rendezvous failed (spares, or shrink
  within MIN);
* ``storage`` -> preflight: EIO, ENOSPC, stale handle, read-only, a hung probe, a remote
  dataset's store unreachable; pre-flight until healthy, then restart;
* ``deterministic`` -> stop: the same failure at the same step twice;
* ``configuration`` -> stop: a refusal at restore (``RestoreRefused``);
* ``preemption`` -> exit: SIGTERM, the job was asked to save.

The supervisor's exit codes are the ``EXIT_*`` constants. What counts as collateral, and
why a signal death is never explained by an earlier message: ARCHITECTURE.md, "Design
notes" > elastic > classifying failures.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import json
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from unbroken.common.procs import signal_name
from unbroken.common.text import printable

__all__ = [
    "DEFAULT_RULES",
    "EXIT_BUDGET",
    "EXIT_CONFIGURATION",
    "EXIT_DETERMINISTIC",
    "EXIT_ERROR",
    "EXIT_NO_PROGRESS",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_PREFLIGHT",
    "EXIT_USAGE",
    "STOP_EXITS",
    "Action",
    "Classification",
    "Decision",
    "Evidence",
    "FaultClass",
    "RestartPolicy",
    "RestartTracker",
    "Rule",
    "WorkerExit",
    "WorkerFailure",
    "classify",
    "collect_worker_failures",
    "parse_rule",
    "signature_of",
]

EXIT_OK = 0
EXIT_ERROR = 1
"""The supervisor itself failed (a bug or an unusable environment)."""
EXIT_USAGE = 2
EXIT_DETERMINISTIC = 3
"""The same failure happened at the same step twice; see RUN_DIR/stop-report.txt."""
EXIT_BUDGET = 4
"""``--max-restarts`` restarts were used up."""
EXIT_NO_PROGRESS = 5
"""``--no-progress-limit`` restarts in a row did not advance the checkpointed step."""
EXIT_PREFLIGHT = 6
"""Pre-flight stayed unhealthy for ``--preflight-max-wait`` seconds."""
EXIT_PREEMPTED = 7
"""SIGTERM/SIGINT: the job was asked to save and stopped; rerun the same command to resume."""
EXIT_CONFIGURATION = 8
"""The checkpoint refused the job (``RestoreRefused``): its configuration (world size,
model shapes, per-rank state) cannot take it; the message says what differs and the fix."""
STOP_EXITS = frozenset({EXIT_DETERMINISTIC, EXIT_BUDGET, EXIT_NO_PROGRESS, EXIT_CONFIGURATION})
"""The exit codes of a ``STOP`` decision: what one supervisor tells the others (``stop``)."""


class FaultClass(str, enum.Enum):
    PROCESS = "process"
    NODE_LOST = "node_lost"
    STORAGE = "storage"
    DETERMINISTIC = "deterministic"
    PREEMPTION = "preemption"
    CONFIGURATION = "configuration"


class Action(str, enum.Enum):
    RESTART = "restart"
    WAIT_FOR_NODES = "wait_for_nodes"
    PREFLIGHT = "preflight"
    STOP = "stop"
    EXIT = "exit"


_ACTION = {
    FaultClass.PROCESS: Action.RESTART,
    FaultClass.NODE_LOST: Action.WAIT_FOR_NODES,
    FaultClass.STORAGE: Action.PREFLIGHT,
    FaultClass.DETERMINISTIC: Action.STOP,
    FaultClass.PREEMPTION: Action.EXIT,
    FaultClass.CONFIGURATION: Action.STOP,
}


@dataclass(frozen=True)
class Rule:
    """One row of the classification table: a regex over the failure text and/or signals."""

    name: str
    fault: FaultClass
    pattern: str | None = None
    """Python regex searched in the primary failure's message, traceback and stderr tail."""
    signals: tuple[str, ...] = ()
    """Signal names (``"SIGSEGV"``) that match when the primary failure died of one."""
    signal_deaths: bool = True
    """Whether ``pattern`` may classify a failure that died of a signal. False for text that
    only an exception produces (a peer error, a traceback): in a rank killed by a signal such
    text is older output, or output of its DataLoader workers, not the cause."""

    def __post_init__(self) -> None:
        if not self.pattern and not self.signals:
            raise ValueError(f"Rule {self.name!r} needs a pattern or signals; give at least one")
        if self.pattern:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"Rule {self.name!r}: bad regex {self.pattern!r}: {e}") from e

    def matches(self, text: str, sig: str | None) -> bool:
        if sig is not None and sig in self.signals:
            return True
        if sig is not None and not self.signal_deaths:
            return False
        return self.pattern is not None and re.search(self.pattern, text) is not None


_P, _N, _S = FaultClass.PROCESS, FaultClass.NODE_LOST, FaultClass.STORAGE

DEFAULT_RULES: tuple[Rule, ...] = (
    # The checkpoint layer's deterministic refusal (issue 21 item 8); first, as its message
    # may name anything (a storage path, an error class) that a later row would take.
    Rule("restore_refused", FaultClass.CONFIGURATION, r"\bRestoreRefused\b", signal_deaths=False),
    Rule(
        "storage",
        _S,
        r"No space left on device|\bENOSPC\b|\[Errno 28\]|Input/output error"
        r"|\bEIO\b|\[Errno 5\]|Stale file handle|\bESTALE\b|\[Errno 116\]|Read-only file system"
        r"|\bEROFS\b|\[Errno 30\]|Disk quota exceeded|\bEDQUOT\b|\[Errno 122\]"
        r"|Transport endpoint is not connected|\[Errno 107\]"
        r"|RemoteStorageError",
    ),  # unbroken.data: an object store failed every retry
    Rule(
        "oom",
        _P,
        r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED"
        r"|\bMemoryError\b|Cannot allocate memory",
    ),
    Rule(
        "cuda",
        _P,
        r"CUDA error|cudaError\w*|CUDNN_STATUS_\w+|CUBLAS_STATUS_\w+|NCCL error"
        r"|ncclUnhandledCudaError|illegal memory access|uncorrectable ECC|\bXid\b",
    ),
    Rule(
        "collective_timeout",
        _P,
        r"Watchdog caught collective operation timeout"
        r"|collective operation timeout|ProcessGroupNCCL.*[Tt]imeout|DistBackendError"
        r"|Timed out waiting|Socket Timeout|gloo.*[Tt]imed out",
    ),
    Rule(
        "peer_lost",
        _P,
        r"Connection closed by peer|Connection reset by peer"
        r"|remote worker crashing|ncclRemoteError|Broken pipe",
        signal_deaths=False,
    ),
    # A state planted in the store, refused by the agent (launch/agent.py): a restart on a
    # fresh key, counted (a stranger who keeps writing ends in the restart budget's stop).
    Rule(
        "rendezvous_state",
        _P,
        r"rendezvous state read from the store is refused",
        signal_deaths=False,
    ),
    Rule(
        "rendezvous",
        _N,
        r"Rendezvous(Timeout|Closed|Connection|State)?Error"
        r"|RendezvousGracefulExitError|The node .* has closed the rendezvous",
        signal_deaths=False,
    ),
    Rule("segfault", _P, signals=("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE")),
    Rule("killed", _P, signals=("SIGKILL",)),
    Rule(
        "exception",
        _P,
        r"\b[A-Z]\w*(Error|Exception)\b|Traceback \(most recent call last\)",
        signal_deaths=False,
    ),
)
"""The built-in classification table, most specific first (storage before generic errors)."""

_COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing|ncclRemoteError"
)


def parse_rule(spec: str) -> Rule:
    """``"storage=Lustre.*evicted"`` -> a user rule (CLI form ``CLASS=REGEX``)."""
    cls, sep, pattern = spec.partition("=")
    values = [c.value for c in FaultClass if c != FaultClass.DETERMINISTIC]
    if not sep or cls.strip() not in values:
        raise ValueError(
            f"--fault-rule {spec!r}: expected CLASS=REGEX with CLASS one of {', '.join(values)}"
        )
    return Rule(f"user:{cls.strip()}", FaultClass(cls.strip()), pattern=pattern)


@dataclass(frozen=True)
class WorkerFailure:
    """One failed worker as torchrun reported it."""

    rank: int
    local_rank: int
    exitcode: int
    pid: int | None = None
    message: str = ""
    traceback: str = ""
    stderr_tail: str = ""
    stopped: bool = False
    """It had been told to stop (by the agent or the supervisor) before it ended."""

    @property
    def signal_name(self) -> str | None:
        return None if self.exitcode >= 0 else signal_name(-self.exitcode)

    @property
    def collateral(self) -> bool:
        """Failed only because another worker failed first."""
        if self.stopped or self.signal_name == "SIGTERM":
            return True  # the agent stops the surviving siblings with SIGTERM
        return bool(_COLLATERAL.search(self.message or self.stderr_tail[-2000:]))


_BLOCK = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*"
    r"\(pid:\s*(\d+)\)[^\n]*\n\s*error_file:\s*(\S+)"
)


def _tail(path: str, nbytes: int = 8192) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


_PREEMPT_EXITS = frozenset(
    {-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT}
)


@dataclass(frozen=True)
class WorkerExit:
    """How one rank ended, as its launcher saw it (a ``worker_exit`` event, see ``launch.worker``)."""

    rank: int | None
    local_rank: int | None
    exitcode: int | None
    """Exit status; negative: killed by that signal; None: unknown."""
    stopped: bool
    """Its launcher had been sent a stop signal (agent or supervisor) before it ended."""
    pid: int | None
    launcher: int | None
    t: float
    via: str = ""
    vanished: bool = False
    """The launcher died without reporting (SIGKILL): nothing is known of the worker."""

    @classmethod
    def from_event(cls, e: dict[str, Any]) -> WorkerExit:
        return cls(
            e.get("rank"),
            e.get("local_rank"),
            e.get("exitcode"),
            bool(e.get("stopped")),
            e.get("worker_pid"),
            e.get("pid"),
            float(e.get("t", 0.0)),
            str(e.get("via", "")),
        )

    @property
    def failed(self) -> bool:
        """A failure of its own: not a clean exit, not told to stop, not a preemption exit
        (SIGTERM/SIGINT or 143/130 from a job that saved on SIGTERM)."""
        if self.exitcode is None:
            return True
        return self.exitcode != 0 and not self.stopped and self.exitcode not in _PREEMPT_EXITS

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else f"launcher {self.launcher}"
        if self.vanished:
            return f"{who}: its process {self.launcher} vanished (SIGKILL) without an exit status"
        if self.exitcode is None:
            return f"{who} ended with an unknown status (its fork server died)"
        if self.exitcode < 0:
            return f"{who} (pid {self.pid}) died of {signal_name(-self.exitcode)}"
        return f"{who} (pid {self.pid}) exited with code {self.exitcode}"


def collect_worker_failures(
    console: str, log_dir: str, exits: Sequence[WorkerExit] = ()
) -> list[WorkerFailure]:
    """Worker failures of one attempt, the primary one first.

    The launchers' ``exits`` give rank, exit code or signal, whether the rank had been told
    to stop, and the order of the failures; torchrun's summary (when it printed one) gives
    the same for ranks without a launcher report; the ``@record`` error file gives the
    message and call stack; ``--tee`` log files give each rank's stderr.
    """
    found, order = _from_launchers(log_dir, exits)
    for m in _BLOCK.finditer(console):
        rank, local, code, pid, efile = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5]
        if rank in found:
            continue
        # The console carries the workers' own output: a path in it is read only inside
        # this attempt's log directory.
        msg, tb = _read_error_file(efile) if _inside(efile, log_dir) else ("", "")
        found[rank] = WorkerFailure(rank, local, code, pid, msg, tb, "")
    # Error files of ranks the summary did not list (e.g. torchrun itself was killed).
    for efile in glob.glob(os.path.join(log_dir, "**", "error.json"), recursive=True):
        name = os.path.basename(os.path.dirname(efile))
        local = int(name) if name.isdigit() else -1
        if any(f.local_rank == local for f in found.values()):
            continue
        msg, tb = _read_error_file(efile)
        found[10_000 + local] = WorkerFailure(-1, local, 1, None, msg, tb, "")
    out = [
        dataclasses.replace(f, stderr_tail=_stderr_tail(log_dir, f.local_rank))
        for f in found.values()
    ]
    # launcher reports in the order the ranks ended, then the others by rank
    return sorted(out, key=lambda f: (f.collateral, order.get(f.rank, len(order)), f.rank))


def _from_launchers(
    log_dir: str, exits: Sequence[WorkerExit]
) -> tuple[dict[int, WorkerFailure], dict[int, int]]:
    """The failures the launchers reported (by rank), and the order the ranks ended in."""
    found: dict[int, WorkerFailure] = {}
    order: dict[int, int] = {}
    # A rank can end more than once in an attempt (torchrun restarts the group in place when
    # a node joins): its first failure of its own counts, else its latest end.
    last: dict[int, WorkerExit] = {}
    for x in sorted(exits, key=lambda x: x.t):
        if x.rank is not None and (x.rank not in last or not last[x.rank].failed):
            last[x.rank] = x
    for x in sorted(last.values(), key=lambda x: x.t):
        if x.exitcode == 0 or x.rank is None:
            continue
        local = x.local_rank if x.local_rank is not None else -1
        efiles = sorted(
            glob.glob(os.path.join(log_dir, "**", str(local), "error.json"), recursive=True)
        )
        msg, tb = _read_error_file(efiles[-1]) if efiles else ("", "")
        if x.exitcode is None or x.vanished:
            msg = msg or x.describe()
        code = 1 if x.exitcode is None else x.exitcode
        found[x.rank] = WorkerFailure(x.rank, local, code, x.pid, msg, tb, "", not x.failed)
        order[x.rank] = len(order)
    return found, order


def _stderr_tail(log_dir: str, local_rank: int) -> str:
    err = sorted(
        glob.glob(os.path.join(log_dir, "**", str(local_rank), "stderr.log"), recursive=True)
    )
    return _tail(err[-1]) if err else ""


def _inside(path: str, root: str) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, top]) == top


_MAX_ERROR_FILE = 4 << 20
"""What the launcher hands torchrun at most (``launch.worker`` shortens a bigger file to
the start of its message): a message of a few MB, twice in torch's file, is read whole."""


def _read_error_file(path: str) -> tuple[str, str]:
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fh:
            data = json.loads(fh.read(_MAX_ERROR_FILE))
        m = data.get("message", {})
        if isinstance(m, dict):
            return str(m.get("message", "")), str(m.get("extraInfo", {}).get("py_callstack", ""))
        return str(m), ""
    except (OSError, ValueError, AttributeError):
        return "", ""


@dataclass(frozen=True)
class Evidence:
    """Everything known about one failed attempt."""

    kind: str
    """``exit`` (torchrun exited non-zero), ``hang`` (watchdog), ``agent_lost`` (torchrun
    killed by a signal we did not send), ``peer`` (another node failed) or ``preempted``."""
    exit_code: int | None = None
    failures: tuple[WorkerFailure, ...] = ()
    console_tail: str = ""
    step: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Classification:
    fault: FaultClass
    action: Action
    rule: str
    reason: str
    signature: str | None = None
    """What makes two failures 'the same' (None: environmental, never deterministic)."""
    counts: bool = True
    """Whether the restart this causes uses the restart budget (waiting for nodes does not)."""


_NUMS = re.compile(r"0x[0-9a-fA-F]+|\d{5,}|(?<=process )\d+|(?<=pid )\d+|(?<=launcher )\d+")
"""Numbers that differ between two attempts of the same bug: addresses, long numbers, and
process ids of any length (a vanished launcher is described by its pid)."""
_MAX_LINE = 500
"""Characters of an exception line a signature keeps (records, supervisor.json)."""
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def signature_of(f: WorkerFailure) -> str:
    """A stable fingerprint: exception line (long numbers masked) + innermost user frame."""
    if f.signal_name and not f.message:
        return f"signal {f.signal_name}"
    text = f.message or _last_exception_line(f.stderr_tail) or f"exit {f.exitcode}"
    frames = _FRAME.findall(f.traceback or f.stderr_tail)
    user = [fr for fr in frames if "site-packages" not in fr[0] and "<frozen" not in fr[0]]
    where = f" @ {os.path.basename(user[-1][0])}:{user[-1][1]}" if user else ""
    line = text.strip().splitlines()[-1] if text.strip() else text
    return printable(_NUMS.sub("#", line[:_MAX_LINE])) + printable(where)


def _last_exception_line(text: str) -> str:
    for line in reversed(text.strip().splitlines()):
        s = line.strip()
        if re.match(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", s):
            return re.sub(r"^\[rank\d+\]:\s*", "", s)
    return ""


def classify(ev: Evidence, rules: Sequence[Rule] = DEFAULT_RULES) -> Classification:
    """Map the evidence of one failed attempt to a fault class and an action."""
    if ev.kind == "preempted":
        return _mk(FaultClass.PREEMPTION, "preempted", "SIGTERM/SIGINT received by the supervisor")
    if ev.kind == "peer":
        return _mk(_P, "peer", ev.detail or "another node failed; the group restarts")
    if ev.kind == "agent_lost":
        return _mk(_N, "agent_lost", ev.detail or "the torchrun agent on this node died")
    if ev.kind == "hang":
        return _mk(
            _P, "hang", ev.detail or "no progress beats within --hang-timeout", signature="hang"
        )
    primary = ev.failures[0] if ev.failures else None
    if primary is not None and all(
        f.signal_name in ("SIGTERM", "SIGINT") or f.exitcode in _PREEMPT_EXITS for f in ev.failures
    ):
        how = primary.signal_name or f"exit code {primary.exitcode}"
        return _mk(
            FaultClass.PREEMPTION,
            "sigterm",
            f"workers stopped ({how}) by a signal from outside the supervisor",
        )
    # A rank's deterministic refusal is the cause wherever it is in the list: the ranks
    # waiting on it in a collective may have ended first (while it tore down), with errors
    # that read as their own.
    refusals = [r for r in rules if r.fault is FaultClass.CONFIGURATION]
    primary = next(
        (f for f in ev.failures if any(r.matches(_text_of(f), f.signal_name) for r in refusals)),
        primary,
    )
    sig = primary.signal_name if primary else None
    text = ev.console_tail[-4000:] if primary is None else _text_of(primary)
    for rule in rules:
        if rule.matches(text, sig):
            reason = _reason(primary, rule.name, rule.pattern, text)
            signature = None
            if rule.fault is _P and primary is not None and not primary.collateral:
                signature = signature_of(primary)
            return _mk(
                rule.fault,
                rule.name,
                reason,
                signature=signature,
                counts=rule.fault is not FaultClass.NODE_LOST,
            )
    # the worker's own status: torchrun's is None while its agent is kept for the restart
    reason = _reason(primary, "unknown") if primary else f"exit code {ev.exit_code}"
    return _mk(
        _P,
        "unknown",
        reason,
        signature=signature_of(primary) if primary and not primary.collateral else None,
    )


def _text_of(f: WorkerFailure) -> str:
    """What the rules read of a failed worker: its message, call stack and stderr."""
    return "\n".join((f.message, f.traceback, f.stderr_tail))


def _reason(
    primary: WorkerFailure | None, name: str, pattern: str | None = None, text: str = ""
) -> str:
    """``name`` (the rule's) and what the primary failure said, else torchrun's line."""
    if primary is None:  # the console's line the rule matched says what torchrun died of
        hit = pattern and next((ln for ln in text.splitlines() if re.search(pattern, ln)), None)
        if hit:
            return f"{name}: torchrun failed: {printable(hit.strip())}"[:400]
        return f"{name}: torchrun failed (no worker failure reported)"
    what = printable((primary.message or _last_exception_line(primary.stderr_tail))[:300])
    if primary.signal_name:
        what = f"died of {primary.signal_name}" + (f": {what}" if what else "")
    return f"{name}: rank {primary.rank}: {what or f'exit code {primary.exitcode}'}"[:300]


def _mk(
    fault: FaultClass, rule: str, reason: str, *, signature: str | None = None, counts: bool = True
) -> Classification:
    return Classification(fault, _ACTION[fault], rule, reason, signature, counts)


# --- restart policy --------------------------------------------------------------------


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart, how long to wait, and when to give up."""

    max_restarts: int = 10
    """Restarts allowed in this supervisor's life (waiting for nodes does not count)."""
    backoff_initial: float = 1.0
    """Seconds before a restart when the failed attempt did not advance the checkpointed
    step; doubled per further restart without progress. A restart after progress is
    immediate: waiting would only add to the recovery time of an ordinary crash."""
    backoff_max: float = 60.0
    """Cap on the backoff (seconds)."""
    backoff_factor: float = 2.0
    no_progress_limit: int = 3
    """Stop after this many restarts in a row that did not advance the checkpointed step
    (restarts that use no budget, such as waiting for nodes, count here too: a lost node
    that keeps failing the job must not restart it forever)."""
    same_failure_limit: int = 2
    """Stop when the same failure (signature and step) has happened this many times."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} is negative; pass >= 0")
        if self.backoff_initial < 0 or self.backoff_max < self.backoff_initial:
            raise ValueError(
                f"backoff_initial={self.backoff_initial}, backoff_max={self.backoff_max}: need "
                "0 <= backoff_initial <= backoff_max"
            )
        if self.backoff_factor < 1:
            raise ValueError(f"backoff_factor={self.backoff_factor} < 1; pass >= 1")
        if self.no_progress_limit < 1 or self.same_failure_limit < 2:
            raise ValueError(
                f"no_progress_limit={self.no_progress_limit} must be >= 1 and "
                f"same_failure_limit={self.same_failure_limit} >= 2"
            )


@dataclass(frozen=True)
class Decision:
    action: Action
    delay: float = 0.0
    exit_code: int | None = None
    """Set when the supervisor must stop (``action`` is STOP or EXIT)."""
    reason: str = ""
    fault: FaultClass | None = None


@dataclass
class RestartTracker:
    """The supervisor's restart bookkeeping (``state_dict`` goes into RUN_DIR/supervisor.json)."""

    policy: RestartPolicy
    restarts: int = 0
    no_progress: int = 0
    best_progress: int | None = None
    history: list[tuple[str, int | None]] = field(default_factory=list)

    def decide(self, c: Classification, progress: int | None, step: int | None) -> Decision:
        """Record one classified failure; ``progress`` is the checkpointed step now."""
        p = self.policy
        if c.action is Action.EXIT:
            return Decision(Action.EXIT, 0.0, EXIT_PREEMPTED, c.reason, c.fault)
        if c.fault is FaultClass.CONFIGURATION:  # refused again on any restart: no retries
            return Decision(Action.STOP, 0.0, EXIT_CONFIGURATION, c.reason, c.fault)
        if c.signature is not None:
            seen = sum(1 for s in self.history if s == (c.signature, step))
            self.history.append((c.signature, step))
            if seen + 1 >= p.same_failure_limit:
                return Decision(
                    Action.STOP,
                    0.0,
                    EXIT_DETERMINISTIC,
                    f"the same failure happened {seen + 1} times "
                    f"{'before the first step' if step is None else f'at step {step}'}: "
                    f"{c.signature}",
                    FaultClass.DETERMINISTIC,
                )
        if progress is not None and (self.best_progress is None or progress > self.best_progress):
            self.best_progress = progress
            self.no_progress = 0
        else:
            self.no_progress += 1
            if self.no_progress >= p.no_progress_limit:
                return Decision(
                    Action.STOP,
                    0.0,
                    EXIT_NO_PROGRESS,
                    f"{self.no_progress} restarts in a row without advancing the checkpointed "
                    f"step (still {self.best_progress})",
                    c.fault,
                )
        if not c.counts:  # no budget used, but guarded and backed off like any restart
            return Decision(c.action, self._delay(), None, c.reason, c.fault)
        if self.restarts >= p.max_restarts:
            return Decision(
                Action.STOP,
                0.0,
                EXIT_BUDGET,
                f"restart budget used up ({p.max_restarts} restarts)",
                c.fault,
            )
        self.restarts += 1
        return Decision(c.action, self._delay(), None, c.reason, c.fault)

    def _delay(self) -> float:
        p = self.policy
        if self.no_progress == 0:
            return 0.0
        return min(p.backoff_max, p.backoff_initial * p.backoff_factor ** (self.no_progress - 1))

    def state_dict(self) -> dict[str, Any]:
        return {
            "restarts": self.restarts,
            "no_progress": self.no_progress,
            "best_progress": self.best_progress,
            "history": [list(h) for h in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restarts = int(state["restarts"])
        self.no_progress = int(state["no_progress"])
        bp = state.get("best_progress")
        self.best_progress = None if bp is None else int(bp)
        self.history = [
            (str(s), None if st is None else int(st)) for s, st in state.get("history") or []
        ]
