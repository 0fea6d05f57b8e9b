"""How the drill judges each fault without running a job: which steps each fault's recovery
produced and were compared, "not checked" after a divergence, and a diagnosis that names the
component the state audit (unbroken.common.audit) finds not restored."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from unbroken.common.audit import StateAudit, fingerprint, read_audit
from unbroken.elastic.drill.judge import (
    Check,
    FaultResult,
    RunComparison,
    _order_check,
    _state_check,
    audit_restore,
    diagnose,
    evaluate_fault,
    judge_trajectories,
    unplanned_failures,
)
from unbroken.elastic.drill.plan import FaultSpec, Injection


def _log(n: int, *, bad_from: int | None = None, ids: bool = True) -> list[dict[str, Any]]:
    out = []
    for s in range(1, n + 1):
        r: dict[str, Any] = {"step": s, "loss": 1.0 / s}
        if bad_from is not None and s >= bad_from:
            r["loss"] += 1e-7
        if ids:
            r["ids"] = [2 * s, 2 * s + 1]
        out.append(r)
    return out


def _fault(i: int, t: float, restored: int | None) -> FaultResult:
    inj = Injection(FaultSpec(i, "kill", "single", 0), t=t)
    return FaultResult(inj, [Check("injected", True, "")], restored=restored)


def _judge(
    faults: list[FaultResult],
    got: list[dict[str, Any]],
    ref: list[dict[str, Any]],
    exact_until: int | None = None,
    findings: Any = None,
) -> RunComparison:
    cmp = RunComparison("single", "ref", "job", 1, exact_until, [], {})
    judge_trajectories(faults, cmp, got, ref, findings)
    return cmp


def _traj(f: FaultResult) -> Check:
    return next(c for c in f.checks if c.name == "trajectory")


def test_each_fault_says_which_steps_it_compared():
    faults = [_fault(1, 10.0, 10), _fault(2, 20.0, 25), _fault(3, 30.0, 35)]
    cmp = _judge(faults, _log(50), _log(50))
    assert [_traj(f).detail for f in faults] == [
        "loss and sample ids of steps 11..25 identical to the reference",
        "loss and sample ids of steps 26..35 identical to the reference",
        "loss and sample ids of steps 36..50 identical to the reference",
    ]
    assert all(f.verdict == "NOT CHECKED" for f in faults)  # no state audit: restore n/c
    assert cmp.checks == []


def test_only_the_fault_whose_steps_diverge_fails_and_later_ones_are_not_checked():
    faults = [_fault(1, 10.0, 10), _fault(2, 20.0, 25), _fault(3, 30.0, 35)]
    _judge(faults, _log(50, bad_from=28), _log(50))
    first, second, third = (_traj(f) for f in faults)
    assert first.ok and not first.skipped and "steps 11..25" in first.detail
    assert not second.ok and second.detail.startswith(
        "steps 26..35 compared: the loss differs from step 28 on"
    )
    assert (
        third.ok
        and third.skipped
        and third.detail
        == ("not checked: the run had already diverged at step 28 after fault #2's recovery")
    )
    assert [f.verdict for f in faults] == ["NOT CHECKED", "FAIL", "NOT CHECKED"]


def test_other_samples_steps_rolled_back_and_a_divergence_before_any_fault():
    got = _log(30)
    got[20]["ids"] = [0, 1]  # step 21 consumed other samples
    faults = [_fault(1, 10.0, 10), _fault(2, 20.0, 20), _fault(3, 21.0, 20)]
    _judge(faults, got, _log(30))
    assert _traj(faults[0]).detail.startswith("loss and sample ids of steps 11..20 identical")
    # fault 3 struck before a new checkpoint: fault 2's steps were all rolled back
    assert _traj(faults[1]).skipped and "rolled the job back to step 20" in _traj(faults[1]).detail
    assert (
        not _traj(faults[2]).ok
        and "other samples than the reference at step 21" in _traj(faults[2]).detail
    )
    cmp = _judge([_fault(1, 10.0, 10)], _log(30, bad_from=4), _log(30))
    assert cmp.checks[0].name == "before any fault" and "step 4" in cmp.checks[0].detail


def test_after_a_world_size_change_only_sample_ids_are_compared():
    faults = [_fault(1, 10.0, 10), _fault(2, 20.0, 20)]
    _judge(faults, _log(40, bad_from=21), _log(40), exact_until=20)
    assert (
        _traj(faults[0]).detail == "loss and sample ids of steps 11..20 identical to the reference"
    )
    assert _traj(faults[1]).ok and _traj(faults[1]).detail.startswith(
        "sample ids of steps 21..40 identical to the reference (another world size from step 21"
    )
    again = [_fault(1, 10.0, 10), _fault(2, 20.0, 20)]
    _judge(again, _log(40, ids=False), _log(40, ids=False))
    assert "loss (no sample ids logged)" in _traj(again[1]).detail


class _Comm:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world


class _State:
    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, Any]:
        return self.sd


def _sd(h: torch.Tensor, w: float, step: int = 10, rng: int = 7) -> dict[str, Any]:
    return {
        "counters": {"step": step},
        "components": {"model": {"w": torch.full((3,), w)}, "extra.hidden": {"h": h}},
        "rng": {"torch": torch.tensor([rng], dtype=torch.uint8), "python": (3, (1, 2, 3), None)},
    }


def test_audit_names_a_per_rank_state_that_came_back_with_rank_0s_value(tmp_path):
    """Two ranks each save their own hidden state; rank 1 restores rank 0's: the restore check
    and the diagnosis name extra.hidden and say rank 1 holds rank 0's value."""
    run, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    h = {0: torch.zeros(2), 1: torch.ones(2)}
    for root in (run, ref):
        for r in (0, 1):
            a = StateAudit(root, _State(_sd(h[r], 1.0)), _Comm(r, 2))
            sd = _sd(h[r], 1.0)
            rng = sd.pop("rng")
            a.saved(10, sd, rng)
            a.step(11)
            if root == ref:
                a.state = _State(_sd(h[r], 2.0, 11))
                a._armed = 10
                a.step(11)
    for r in (0, 1):  # the drilled run restores: rank 1 gets rank 0's hidden state
        a = StateAudit(run, _State(_sd(h[0], 1.0)), _Comm(r, 2))
        a.restored(10)
    f = audit_restore(0.0, 10, read_audit(run), read_audit(ref))
    assert f is not None and f.ranks == [0, 1] and f.restore_diff == {1: ["extra.hidden/h"]}
    assert f.from_rank0 == {1: ["extra.hidden/h"]}
    faults = [_fault(1, 0.0, 10)]
    _judge(faults, _log(20, bad_from=11), _log(20), findings={1: f})
    restore = next(c for c in faults[0].checks if c.name == "restore")
    assert not restore.ok and "on rank 1, extra.hidden (h) not as saved" in restore.detail
    assert "holds rank 0's value" in restore.detail and "saved once, not per rank" in restore.detail
    assert "extra.hidden (h)" in _traj(faults[0]).detail


def test_audit_names_what_changed_after_the_restore_and_ignores_unseeded_noise(tmp_path):
    run, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    h = torch.zeros(2)
    ra = StateAudit(ref, _State(_sd(h, 2.0, 11, rng=5)), _Comm(0, 1))
    sd = _sd(h, 1.0)
    ra.saved(10, {k: v for k, v in sd.items() if k != "rng"}, sd["rng"])
    ra.step(11)
    # the drilled run: python's RNG was never seeded (differs everywhere: noise); the script
    # re-seeded torch after restore() (the cause), so the step's weights differ (the effect)
    noisy = _sd(h, 1.0)
    noisy["rng"]["python"] = (3, (9, 9, 9), None)
    a = StateAudit(run, _State(noisy), _Comm(0, 1))
    a.saved(10, {k: v for k, v in noisy.items() if k != "rng"}, noisy["rng"])
    a.restored(10)
    after = _sd(h, 2.5, 11, rng=99)
    after["rng"]["python"] = (3, (9, 9, 9), None)
    a.state = _State(after)
    a.step(11)
    f = audit_restore(0.0, 10, read_audit(run), read_audit(ref))
    assert f is not None and not f.restore_diff
    assert f.step_diff == {0: ["d:rng/torch", "f:model/w"]}
    faults = [_fault(1, 0.0, 10)]
    _judge(faults, _log(20, bad_from=11), _log(20), findings={1: f})
    assert next(c for c in faults[0].checks if c.name == "restore").ok
    why = _traj(faults[0]).detail
    assert "one step later (step 11) rng differs from the reference: rng (torch)" in why
    assert "python" not in why


def test_fingerprint_kinds_and_collapsed_scalar_lists():
    fp = fingerprint(
        {
            "components": {
                "m": {
                    "w": torch.ones(3),
                    "s": torch.tensor(2.0),
                    "n": torch.tensor(3),
                    "lr": 0.1,
                    "ids": [0, 1, 2],
                }
            }
        },
        {"python": (3, tuple(range(625)), None)},
    )
    assert {k: v[0] for k, v in fp.items()} == {
        "m/w": "f",
        "m/s": "s",
        "m/n": "d",
        "m/lr": "s",
        "m/ids": "d",
        "rng/python/0": "d",
        "rng/python/1": "d",
        "rng/python/2": "d",
    }


@pytest.mark.parametrize(
    ("res", "restored", "words"),
    [
        (
            {"first_sample_diff": 320, "first_sample_step": 21, "first_sample_ids": (7, 9)},
            20,
            [
                "data position was not restored",
                "sample #320 (step 21)",
                "id 9 where the reference had 7",
            ],
        ),
        ({"first_sample_diff": None, "first_loss_diff": 21}, 20, ["forward pass", "RNG"]),
        ({"first_sample_diff": None, "first_loss_diff": 22}, 20, ["optimizer update", "step 22"]),
        ({"first_sample_diff": None, "first_loss_diff": 23}, 20, ["learning-rate schedule"]),
        (
            {"first_sample_diff": None, "first_loss_diff": 18},
            20,
            ["metric log was not rolled back"],
        ),
    ],
)
def test_diagnosis_from_where_the_runs_part(res, restored, words):
    text = diagnose(res, restored)
    for w in words:
        assert w in text, text


def test_failures_no_injection_explains_fail_the_drill():
    def fail(t: float, step: int) -> dict:
        return {"t": t, "step": step, "fault": "process", "rule": "hang", "reason": "stalled"}

    ok = unplanned_failures(
        [10.0, 20.0], [("A", fail(10.5, 7)), ("B", fail(10.6, 7)), ("A", fail(21.0, 15))]
    )
    assert ok.ok and "3 recorded" in ok.detail
    bad = unplanned_failures(
        [10.0, 20.0], [("A", fail(5.0, 3)), ("A", fail(10.5, 7)), ("A", fail(12.0, 9))]
    )
    assert not bad.ok
    assert "2 failure(s) no injected fault explains" in bad.detail
    assert "node A at step 3: process/hang" in bad.detail and "step 9" in bad.detail


def test_a_stop_after_a_fault_is_shown_with_its_exit_code_and_message():
    """issue 21 item 8: the drill's table says why the job did not come back: the
    supervisor's stop, its exit code and the refusal's message (not "did not come back")."""
    inj = Injection(FaultSpec(1, "world-size", "elastic", 12), t=100.0)
    ev = [
        {"t": 100.0, "event": "launch", "attempt": 0},
        {
            "t": 101.0,
            "event": "failure",
            "attempt": 0,
            "kind": "exit",
            "fault": "node_lost",
            "t_fail": 100.5,
            "t_detect": 101.0,
        },
        {"t": 102.0, "event": "launch", "attempt": 1},
        {
            "t": 105.0,
            "t_fail": 104.0,
            "t_detect": 105.0,
            "event": "failure",
            "attempt": 1,
            "kind": "exit",
            "fault": "configuration",
            "rule": "restore_refused",
            "action": "stop",
            "stop_code": 8,
            "reason": "restore_refused: rank 0: RestoreRefused: checkpoint step 10 was saved by "
            "2 ranks and this job has 1",
        },
    ]
    res = evaluate_fault(inj, ev, "", [])
    (rec,) = [c for c in res.checks if c.name == "recovered"]
    assert not rec.ok
    assert "stopped (exit 8, configuration/restore_refused)" in rec.detail, rec.detail
    assert "saved by 2 ranks and this job has 1" in rec.detail
    assert not res.passed


def test_a_resized_run_without_sample_ids_is_not_checked_not_passed():
    """issue 21 item 9: after a world-size change with no sample ids logged nothing of the
    fault's steps can be compared: the row says NOT CHECKED and why, never PASS."""
    faults = [_fault(1, 10.0, 10), _fault(2, 20.0, 20)]
    _judge(faults, _log(40, ids=False), _log(40, ids=False), exact_until=20)
    first, second = (_traj(f) for f in faults)
    assert first.ok and not first.skipped and "loss (no sample ids logged)" in first.detail
    assert second.ok and second.skipped, second
    assert second.detail.startswith("not checked: no sample ids logged"), second.detail
    assert faults[1].verdict == "NOT CHECKED"


def _res(**kw: Any) -> dict[str, Any]:
    res: dict[str, Any] = {
        "model": [],
        "counters": [],
        "scalar_diffs": {},
        "skipped_float_leaves": 0,
        "duplicated_steps": 0,
        "first_loss_diff": None,
        "loss_at_diff": None,
        "first_sample_diff": None,
        "first_sample_step": None,
        "first_sample_ids": None,
        "missing_samples": 0,
        "extra_samples": 0,
        "identical": True,
        "ids_logged": False,
    }
    res.update(kw)
    return res


def test_the_order_row_says_not_checked_and_names_the_loader_only_when_there_is_one():
    """issue 21 item 9: "not checked: no sample ids logged"; the loader's position line
    only when the final state holds a loader."""
    plain = _order_check(_res(), [{"step": 1, "loss": 1.0}])
    assert plain.ok and plain.skipped and plain.mark == "n/c "
    assert plain.detail.startswith("not checked: no sample ids logged"), plain.detail
    assert "loader" not in plain.detail
    with_loader = _order_check(_res(loader=[]), [{"step": 1, "loss": 1.0}])
    assert "the loader's position (loader) is compared in the final state" in with_loader.detail


def test_keys_declared_to_differ_after_a_resize_are_left_out_with_their_reason():
    """issue 21 item 9: a value computed on re-derived RNG after a resize is declared; it is
    not compared and the reason is printed. Undeclared, or without a resize, it fails."""
    res = _res(values=["/best_val_loss"], scalar_diffs={"values/best_val_loss": (1.25, 1.5)})
    why = {"values/best_val_loss": "eval batches drawn from per-rank RNG"}
    ok = _state_check(res, 21, why)
    assert ok.ok, ok
    assert (
        "declared to differ after a resize, not compared: values/best_val_loss: eval batches "
        "drawn from per-rank RNG"
    ) in ok.detail
    bad = _state_check(res, 21, {})
    assert not bad.ok and "values/best_val_loss: 1.25 in the reference, 1.5 here" in bad.detail
    no_resize = _state_check(res, None, why)
    assert not no_resize.ok  # a declaration covers a resize only
