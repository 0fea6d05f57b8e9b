"""Fault classification (E-CLASSIFY) and the restart policy.

The torchrun evidence is produced with torch's own machinery: error files written by
``ErrorHandler.record_exception`` (what ``@record`` does in a worker) and the failure summary
formatted by ``ChildFailedError`` (what torchrun prints), so the parser meets the real format.
"""

from __future__ import annotations

import errno
import os

import pytest
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ErrorHandler,
    ProcessFailure,
)

from unbroken.elastic import faults
from unbroken.elastic.faults import (
    Action,
    Classification,
    Evidence,
    FaultClass,
    RestartPolicy,
    RestartTracker,
    WorkerFailure,
    classify,
    collect_worker_failures,
    parse_rule,
    signature_of,
)


def _raise(exc: BaseException) -> None:
    raise exc


def _torchrun_output(tmp_path, failures: dict[int, tuple[int, BaseException | None]]):
    """Error files in torchrun's --log-dir layout plus torchrun's console summary."""
    log_dir = tmp_path / "torchelastic"
    procs = {}
    for rank, (code, exc) in failures.items():
        d = log_dir / "job_abc" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        efile = d / "error.json"
        if exc is not None:
            os.environ["TORCHELASTIC_ERROR_FILE"] = str(efile)
            try:
                try:
                    _raise(exc)
                except BaseException as e:  # noqa: BLE001 - recording it is the point
                    ErrorHandler().record_exception(e)
            finally:
                del os.environ["TORCHELASTIC_ERROR_FILE"]
        (d / "stderr.log").write_text(f"[rank{rank}]: some output\n")
        procs[rank] = ProcessFailure(rank, 1000 + rank, code, str(efile))
    console = ChildFailedError("train.py", procs).format_msg()
    return console, str(log_dir)


def test_root_cause_skips_collateral_peer_errors(tmp_path):
    console, log_dir = _torchrun_output(
        tmp_path,
        {
            0: (
                1,
                RuntimeError(
                    "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:44742"
                ),
            ),
            1: (1, ValueError("boom at step 7")),
        },
    )
    fails = collect_worker_failures(console, log_dir)
    assert [f.rank for f in fails] == [1, 0]
    assert fails[0].message == "ValueError: boom at step 7" and fails[1].collateral
    c = classify(Evidence("exit", 1, tuple(fails), console, step=6))
    assert (c.fault, c.action, c.rule) == (FaultClass.PROCESS, Action.RESTART, "exception")
    assert c.signature is not None and c.signature.startswith("ValueError: boom at step 7 @ ")
    assert "test_faults.py" in c.signature  # innermost frame outside site-packages
    assert "rank 1" in c.reason


def test_sigkilled_worker_without_error_file(tmp_path):
    console, log_dir = _torchrun_output(tmp_path, {0: (-9, None), 1: (-15, None)})
    fails = collect_worker_failures(console, log_dir)
    assert (fails[0].signal_name, fails[0].rank) == ("SIGKILL", 0)
    c = classify(Evidence("exit", 1, tuple(fails), console))
    assert (c.fault, c.rule, c.signature) == (FaultClass.PROCESS, "killed", "signal SIGKILL")
    assert "died of SIGKILL" in c.reason


@pytest.mark.parametrize(
    ("stderr", "sig", "rule"),
    [
        # older output of the rank (or of its DataLoader workers) did not kill it
        ("ConnectionResetError: [Errno 104] Connection reset by peer", -9, "killed"),
        ("BrokenPipeError: [Errno 32] Broken pipe", -9, "killed"),
        ("Traceback (most recent call last):\nValueError: caught and logged", -9, "killed"),
        ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", -9, "killed"),
        # text that explains a signal still wins over the bare signal
        ("RuntimeError: CUDA error: an illegal memory access was encountered", -6, "cuda"),
        ("OSError: [Errno 5] Input/output error", -7, "storage"),
    ],
)
def test_a_rank_killed_by_a_signal_is_classified_by_what_can_explain_it(
    tmp_path, stderr, sig, rule
):
    console, log_dir = _torchrun_output(tmp_path, {0: (sig, None)})
    (tmp_path / "torchelastic" / "job_abc" / "attempt_0" / "0" / "stderr.log").write_text(
        stderr + "\n"
    )
    c = classify(Evidence("exit", 1, tuple(collect_worker_failures(console, log_dir)), console))
    assert c.rule == rule, c
    assert c.fault is (FaultClass.STORAGE if rule == "storage" else FaultClass.PROCESS)


def _exit(rank, code, *, stopped=False, t=0.0, pid=None):
    return faults.WorkerExit(rank, rank, code, stopped, pid or 100 + rank, 200 + rank, t)


def test_launcher_reports_order_the_failures_and_mark_stopped_ranks_collateral(tmp_path):
    """No torchrun summary (the supervisor stopped the agent first): the launchers' reports,
    the error files and the stderr tails are the evidence; the first failure is primary."""
    _console, log_dir = _torchrun_output(
        tmp_path, {0: (1, RuntimeError("boom")), 1: (1, ValueError("first"))}
    )
    exits = [
        _exit(0, 1, t=2.0),
        _exit(1, 1, t=1.0),
        _exit(2, -15, stopped=True, t=3.0),
        _exit(3, 0, t=0.5),
    ]
    fails = collect_worker_failures("", log_dir, exits)
    assert [(f.rank, f.collateral) for f in fails] == [(1, False), (0, False), (2, True)]
    assert fails[0].message == "ValueError: first"
    c = classify(Evidence("exit", None, tuple(fails), ""))
    assert c.rule == "exception" and "rank 1" in c.reason


def test_a_rank_restarted_in_place_is_judged_by_its_own_failure(tmp_path):
    """torchrun stopped rank 0 once to admit a node (SIGTERM, stopped), then its second
    incarnation failed when a peer vanished: that failure is the evidence."""
    _console, log_dir = _torchrun_output(
        tmp_path,
        {
            0: (
                1,
                RuntimeError(
                    "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1947"
                ),
            )
        },
    )
    exits = [_exit(0, -15, stopped=True, t=1.0), _exit(0, 1, t=5.0)]
    (f,) = collect_worker_failures("", log_dir, exits)
    assert (f.exitcode, f.stopped, f.collateral) == (1, False, True)
    c = classify(Evidence("exit", None, (f,), ""))
    assert (c.fault, c.rule) == (FaultClass.PROCESS, "peer_lost"), c


def test_worker_exit_failed_and_described():
    assert _exit(1, -9).failed and "died of SIGKILL" in _exit(1, -9).describe()
    assert _exit(1, 3).failed and "exited with code 3" in _exit(1, 3).describe()
    assert not _exit(1, 0).failed
    assert not _exit(1, -9, stopped=True).failed  # stopped by the agent or the supervisor
    for code in (-15, -2, 143, 130):  # a preemption exit is not a failure of its own
        assert not _exit(1, code).failed
    gone = faults.WorkerExit(None, None, None, False, None, 4242, 0.0, vanished=True)
    assert gone.failed and "vanished" in gone.describe() and "4242" in gone.describe()
    e = faults.WorkerExit.from_event(
        {
            "t": 5.0,
            "event": "worker_exit",
            "rank": 1,
            "local_rank": 1,
            "exitcode": -9,
            "stopped": False,
            "worker_pid": 7,
            "pid": 8,
            "via": "zygote",
        }
    )
    assert (e.rank, e.exitcode, e.pid, e.launcher, e.via, e.failed) == (1, -9, 7, 8, "zygote", True)


def test_every_rank_exiting_143_after_a_save_on_sigterm_is_a_preemption(tmp_path):
    fails = collect_worker_failures("", str(tmp_path), [_exit(0, 143), _exit(1, 143)])
    c = classify(Evidence("exit", 1, tuple(fails), ""))
    assert (c.fault, c.action) == (FaultClass.PREEMPTION, Action.EXIT), c
    assert "exit code 143" in c.reason


class _RestoreRefused(ValueError):
    """Named as ``unbroken.ckpt``'s refusal is (the classification reads the name)."""


_RestoreRefused.__name__ = _RestoreRefused.__qualname__ = "RestoreRefused"


@pytest.mark.parametrize(
    ("exc", "code", "fault", "rule"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), 1, FaultClass.STORAGE, "storage"),
        (OSError(errno.EIO, "Input/output error"), 1, FaultClass.STORAGE, "storage"),
        (OSError(errno.ESTALE, "Stale file handle"), 1, FaultClass.STORAGE, "storage"),
        (
            RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            1,
            FaultClass.PROCESS,
            "oom",
        ),
        (
            RuntimeError("CUDA error: an illegal memory access was encountered"),
            1,
            FaultClass.PROCESS,
            "cuda",
        ),
        (
            RuntimeError(
                "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9,"
                " OpType=ALLREDUCE) ran for 600054 milliseconds before timing out."
            ),
            1,
            FaultClass.PROCESS,
            "collective_timeout",
        ),
        (KeyError("missing"), 1, FaultClass.PROCESS, "exception"),
        # issue 21 item 8: the checkpoint layer's refusal (its message names no storage
        # error, but may name anything: it is matched first)
        (
            _RestoreRefused("step 5 saved by 2 ranks: [Errno 5] in a path name"),
            1,
            FaultClass.CONFIGURATION,
            "restore_refused",
        ),
        (None, -11, FaultClass.PROCESS, "segfault"),
        (None, -7, FaultClass.PROCESS, "segfault"),
    ],
)
def test_table(tmp_path, exc, code, fault, rule):
    console, log_dir = _torchrun_output(tmp_path, {0: (code, exc)})
    c = classify(Evidence("exit", 1, tuple(collect_worker_failures(console, log_dir)), console))
    assert (c.fault, c.rule) == (fault, rule), c
    if fault is FaultClass.STORAGE:
        assert c.signature is None and c.action is Action.PREFLIGHT
    if fault is FaultClass.CONFIGURATION:  # stopped at once, with its own exit code
        d = RestartTracker(RestartPolicy()).decide(c, progress=5, step=5)
        assert (d.action, d.exit_code) == (Action.STOP, faults.EXIT_CONFIGURATION), d
        assert "saved by 2 ranks" in d.reason


def test_a_refusal_by_any_rank_stops_the_job_whichever_rank_ended_first():
    """Rank 0 refuses its restore and exits; rank 1, waiting on it in a collective, can end
    first on a loaded box (rank 0 is still tearing down) with an error that does not read as
    collateral. The refusal is still the cause: a restart would refuse again."""
    peer = WorkerFailure(1, 1, 1, message="RuntimeError: [gloo] Write error: Broken pipe")
    refused = WorkerFailure(0, 0, 1, message="RestoreRefused: step 5 saved by 2 ranks, job has 1")
    c = classify(Evidence("exit", 1, (peer, refused), ""))
    assert (c.fault, c.rule) == (FaultClass.CONFIGURATION, "restore_refused"), c
    assert "saved by 2 ranks" in c.reason, c.reason
    alone = classify(Evidence("exit", 1, (peer,), ""))
    assert alone.fault is FaultClass.PROCESS, alone


def test_structural_kinds_and_rendezvous():
    assert classify(Evidence("hang", detail="x")).signature == "hang"
    lost = classify(Evidence("agent_lost"))
    assert (lost.fault, lost.action) == (FaultClass.NODE_LOST, Action.WAIT_FOR_NODES)
    assert classify(Evidence("preempted")).action is Action.EXIT
    rdzv = classify(
        Evidence(
            "exit",
            1,
            (),
            console_tail=("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"),
        )
    )
    assert (rdzv.fault, rdzv.counts) == (FaultClass.NODE_LOST, False)
    term = (WorkerFailure(0, 0, -15), WorkerFailure(1, 1, -15))
    assert classify(Evidence("exit", 1, term)).fault is FaultClass.PREEMPTION


def test_user_rules_come_first_and_are_validated(tmp_path):
    console, log_dir = _torchrun_output(
        tmp_path,
        {
            0: (1, RuntimeError("LustreError: 11-0: client was evicted by the server")),
        },
    )
    ev = Evidence("exit", 1, tuple(collect_worker_failures(console, log_dir)), console)
    assert classify(ev).fault is FaultClass.PROCESS
    rules = (parse_rule("storage=Lustre.*evicted"), *faults.DEFAULT_RULES)
    c = classify(ev, rules)
    assert (c.fault, c.rule) == (FaultClass.STORAGE, "user:storage")
    for bad in ("bogus=x", "storage", "deterministic=x", "process=(unclosed"):
        with pytest.raises(ValueError, match="CLASS=REGEX|bad regex"):
            parse_rule(bad)
    with pytest.raises(ValueError, match="needs a pattern or signals"):
        faults.Rule("empty", FaultClass.PROCESS)


def test_signature_masks_addresses_and_pids_but_not_small_steps():
    a = WorkerFailure(0, 0, 1, message="RuntimeError: bad tensor at 0x7f3a2b1c pid 123456 step 7")
    b = WorkerFailure(0, 0, 1, message="RuntimeError: bad tensor at 0x7f99ffee pid 654321 step 7")
    c = WorkerFailure(0, 0, 1, message="RuntimeError: bad tensor at 0x7f99ffee pid 654321 step 8")
    assert signature_of(a) == signature_of(b) != signature_of(c)
    tail = WorkerFailure(
        0,
        0,
        1,
        stderr_tail='[rank0]:   File "/x/train.py", line 9, in main\n'
        "[rank0]: ZeroDivisionError: division by zero\n",
    )
    assert signature_of(tail) == "ZeroDivisionError: division by zero @ train.py:9"


def _c(sig: str | None = "E @ t.py:1", fault=FaultClass.PROCESS, counts=True) -> Classification:
    return Classification(fault, faults._ACTION[fault], "r", "reason", sig, counts)


def test_same_failure_at_same_step_twice_stops():
    t = RestartTracker(RestartPolicy())
    assert t.decide(_c(), progress=5, step=6).action is Action.RESTART
    assert t.decide(_c(), progress=10, step=12).action is Action.RESTART  # other step
    d = t.decide(_c(), progress=10, step=6)
    assert (d.action, d.exit_code, d.fault) == (
        Action.STOP,
        faults.EXIT_DETERMINISTIC,
        FaultClass.DETERMINISTIC,
    )
    assert "2 times at step 6" in d.reason


def test_budget_and_environmental_failures():
    t = RestartTracker(RestartPolicy(max_restarts=2, no_progress_limit=10))
    for i in range(2):
        assert t.decide(_c(None), progress=i, step=None).exit_code is None
    assert t.decide(_c(None, FaultClass.NODE_LOST, counts=False), 9, None).exit_code is None
    d = t.decide(_c(None), progress=10, step=None)
    assert (d.action, d.exit_code) == (Action.STOP, faults.EXIT_BUDGET)


def test_no_progress_guard_and_backoff():
    t = RestartTracker(RestartPolicy(backoff_initial=1, backoff_max=5, no_progress_limit=4))
    # a restart after progress is immediate; then 1, 2, 4 s while nothing advances
    delays = [t.decide(_c(None), progress=p, step=None).delay for p in (10, 10, 10, 10)]
    assert delays == [0, 1, 2, 4]
    assert t.decide(_c(None), progress=11, step=None).delay == 0  # progress resets the backoff
    for _ in range(3):
        t.decide(_c(None), progress=11, step=None)
    d = t.decide(_c(None), progress=11, step=None)
    assert (d.action, d.exit_code) == (Action.STOP, faults.EXIT_NO_PROGRESS)
    assert "still 11" in d.reason
    # no checkpoint at all yet (a crash at start-up): back off from the first restart on
    cold = RestartTracker(RestartPolicy(backoff_initial=1, backoff_max=5, no_progress_limit=9))
    assert [cold.decide(_c(None), None, None).delay for _ in range(6)] == [1, 2, 4, 5, 5, 5]


def test_preemption_exits_and_state_round_trip():
    t = RestartTracker(RestartPolicy())
    t.decide(_c(), progress=3, step=4)
    d = t.decide(_c(None, FaultClass.PREEMPTION), progress=3, step=4)
    assert (d.action, d.exit_code) == (Action.EXIT, faults.EXIT_PREEMPTED)
    u = RestartTracker(RestartPolicy())
    u.load_state_dict(t.state_dict())
    assert u.state_dict() == t.state_dict() and u.history == [("E @ t.py:1", 4)]


@pytest.mark.parametrize(
    "kw",
    [
        {"max_restarts": -1},
        {"backoff_initial": 2, "backoff_max": 1},
        {"backoff_factor": 0.5},
        {"no_progress_limit": 0},
        {"same_failure_limit": 1},
    ],
)
def test_policy_validation(kw):
    with pytest.raises(ValueError):
        RestartPolicy(**kw)
