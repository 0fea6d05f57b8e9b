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
    t = RestartTracker(RestartPolicy(backoff_initial=1, backoff_max=5, no_progress_limit=3))
    delays = [t.decide(_c(None), progress=p, step=None).delay for p in (10, 10, 10)]
    assert delays == [1, 2, 4]
    assert t.decide(_c(None), progress=11, step=None).delay == 1  # progress resets the backoff
    for _ in range(2):
        t.decide(_c(None), progress=11, step=None)
    d = t.decide(_c(None), progress=11, step=None)
    assert (d.action, d.exit_code) == (Action.STOP, faults.EXIT_NO_PROGRESS)
    assert "still 11" in d.reason
    capped = RestartTracker(RestartPolicy(backoff_initial=1, backoff_max=5, no_progress_limit=9))
    assert [capped.decide(_c(None), 0, None).delay for _ in range(6)][-1] == 5


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
