"""The drill's verdicts: per fault, per drilled run, and why a run parts from its reference.

Per fault: was it injected, did the supervisor detect and classify it, did the job recover
(the four phases of :mod:`recovery`), did it resume from the checkpoint it had to (the
newest, or the one before a corrupted newest), and the fault's own evidence (stack dumps of
a hang, the quarantined checkpoint, no restart during a storage outage, the world size
after a node left). Per drilled run: the final state, loss curve, data order and metric log
against the reference run (:func:`unbroken.ckpt.compare.compare_runs`).

Each fault's ``trajectory`` check compares the steps its recovery produced - from its
restored step + 1 to the step the next fault's recovery restored - with the reference, and
says which steps it compared. The fault whose steps hold the first difference fails; faults
after it say "not checked: the run had already diverged at step N". Its ``restore`` check
compares, per rank, the state right after the restore with what that rank saved (the state
audit, :mod:`unbroken.common.audit`); the diagnosis names the component that was not brought back,
or that differs from the reference one step after the restore, and only without an audit
guesses from how far past the restore the runs part (:func:`diagnose`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from unbroken.common.jsonable import plain_json
from unbroken.elastic.drill.plan import Injection
from unbroken.elastic.recovery import phases

__all__ = [
    "AuditFinding",
    "Check",
    "FaultResult",
    "RunComparison",
    "audit_restore",
    "explain",
    "first_divergence",
    "judge_trajectories",
    "restore_check",
    "compare_run",
    "diagnose",
    "evaluate_fault",
    "unplanned_failures",
]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    skipped: bool = False
    """Nothing could be compared (``ok`` stays True: it is not a failure, nor a pass)."""
    cause: str = ""
    """The concrete mismatch a failed check found (the report's headline names the first)."""

    @property
    def mark(self) -> str:
        return "FAIL" if not self.ok else "n/c " if self.skipped else "ok  "


@dataclass
class FaultResult:
    injection: Injection
    checks: list[Check]
    failure: dict[str, Any] | None = None
    recovery: dict[str, Any] | None = None
    restored: int | None = None

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def verdict(self) -> str:
        """PASS, FAIL, or NOT CHECKED when a check could compare nothing."""
        if not self.passed:
            return "FAIL"
        return "NOT CHECKED" if any(c.skipped for c in self.checks) else "PASS"

    @property
    def why(self) -> str:
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.ok)


@dataclass
class RunComparison:
    run: str
    reference: str
    job: str
    world_reference: int
    exact_until: int | None
    """Last step compared bit for bit when the world size changed (None: the whole run)."""
    checks: list[Check]
    result: dict[str, Any]
    steps: int = 0

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)


# --- per fault ----------------------------------------------------------------------------

_EXPECTED = {  # what the supervisor must have made of each fault: (field, value)
    "kill": ("fault", "process"),
    "kill-in-save": ("fault", "process"),
    "hang": ("kind", "hang"),
    "corrupt": ("fault", "process"),
    "storage": ("fault", "storage"),
    "agent-loss": ("kind", "agent_lost"),
    "world-size": ("fault", "node_lost"),
    "kill-memory": ("fault", "process"),
    "memory-damage": ("fault", "process"),
    "node-loss": ("fault", "node_lost"),
}


def evaluate_fault(
    inj: Injection,
    events: list[dict[str, Any]],
    ckpt_root: str,
    records: list[dict[str, Any]],
    until: float | None = None,
    joined: list[dict[str, Any]] | None = None,
) -> FaultResult:
    """Checks for one injected fault from the reporting node's events and the metric log
    (``until``: when the next fault was injected; later records are not this fault's;
    ``joined``: the events of a node that replaced a lost one, whose ranks restored too)."""
    kind = inj.spec.kind
    if inj.t is None:
        return FaultResult(inj, [Check("injected", False, inj.error or "never injected")])
    checks = [Check("injected", inj.error is None, inj.error or inj.detail)]
    fail = next((e for e in events if e["event"] == "failure" and e["t"] >= inj.t), None)
    if fail is None:
        checks.append(Check("detected", False, "the supervisor recorded no failure after it"))
        return FaultResult(inj, checks)
    key, want = _EXPECTED[kind]
    checks.append(
        Check(
            "detected",
            fail.get(key) == want,
            f"{fail.get('kind')}: {fail.get('fault')}/{fail.get('rule')} -> {fail.get('action')} "
            f"({str(fail.get('reason', ''))[:90]})"
            + ("" if fail.get(key) == want else f"; expected {key} {want!r}"),
        )
    )
    attempt = int(fail["attempt"])
    rec = next((r for r in phases(events) if r.attempt == attempt), None)
    rec_json = rec.to_json() if rec else None
    loaded = [e for e in events if e["event"] == "loaded" and e.get("attempt") == attempt + 1]
    restored = min((int(e["step"]) for e in loaded), default=None)
    missing = [
        p for p in ("relaunch", "load", "catch_up") if rec is None or getattr(rec, p) is None
    ]
    checks.append(_recovered_check(inj, events, missing, restored))
    checks.append(_restore_check(inj, restored))
    mine = [r for r in records if until is None or float(r.get("time", 0.0)) < until]
    seen = _Seen(events, fail, ckpt_root, mine, restored, joined or [])
    checks += _specific(inj, seen)
    return FaultResult(inj, checks, fail, rec_json, restored)


def _recovered_check(
    inj: Injection, events: list[dict[str, Any]], missing: list[str], restored: int | None
) -> Check:
    """All four phases recorded; or why not: the supervisor's stop (exit code and message,
    e.g. the checkpoint refused the job: issue 21 item 8) when it stopped."""
    if not missing:
        return Check("recovered", restored is not None, "all four phases recorded")
    t0 = inj.t or 0.0
    stop = next(
        (
            e
            for e in events
            if e["event"] == "failure" and e["t"] >= t0 and e.get("action") == "stop"
        ),
        None,
    )
    if stop is None:
        why = f"phases {', '.join(missing)} not recorded (the job did not come back)"
    else:
        why = (
            f"the supervisor stopped (exit {stop.get('stop_code', '?')}, "
            f"{stop.get('fault')}/{stop.get('rule')}): {str(stop.get('reason', ''))[:240]}"
        )
    return Check("recovered", False, why)


_RESTORE_WHAT = {
    "corrupt": "the checkpoint before the corrupted one",
    "kill-memory": "the newest verified memory slot or disk step",
    "memory-damage": "the newest verified memory slot or disk step",
    "node-loss": "the newest step of the survivor's slots its peer replica also holds",
}


def _restore_check(inj: Injection, restored: int | None) -> Check:
    if inj.expected_restore is not None:
        ok = restored == inj.expected_restore
        what = _RESTORE_WHAT.get(inj.spec.kind, "the newest committed checkpoint")
        return Check(
            "resumed", ok, f"restored step {restored}; expected {inj.expected_restore} ({what})"
        )
    if inj.min_restore is not None:
        ok = restored is not None and restored >= inj.min_restore
        return Check(
            "resumed",
            ok,
            f"restored step {restored}; newest checkpoint at the injection was {inj.min_restore}",
        )
    return Check(
        "resumed",
        restored is not None,
        f"restored step {restored} (no checkpoint existed at the injection)",
    )


@dataclass(frozen=True)
class _Seen:
    """What a fault-specific check looks at: the run's events, the failure record, the
    checkpoint root, the metric log and the step restored after the fault."""

    events: list[dict[str, Any]]
    fail: dict[str, Any]
    ckpt_root: str
    records: list[dict[str, Any]]
    restored: int | None
    joined: list[dict[str, Any]]
    """The events of a node that replaced a lost one (its own attempt numbers)."""


def _specific(inj: Injection, seen: _Seen) -> list[Check]:
    """The check that proves this kind of fault was handled the right way (none for a kill)."""
    check = _SPECIFIC.get(inj.spec.kind)
    return [] if check is None else [check(inj, seen)]


def _debris_removed(inj: Injection, seen: _Seen) -> Check:
    f = inj.facts
    left = os.path.exists(os.path.join(seen.ckpt_root, f["tmp_dir"]))
    files = ", ".join(f["tmp_files"]) or "still empty"
    after = (
        "still there after the restore"
        if left
        else f"removed by the restore, step {f['save_step']} never visible"
    )
    return Check("debris", not left, f"half-written {f['tmp_dir']} ({files}) {after}")


def _stacks_dumped(inj: Injection, seen: _Seen) -> Check:
    t0 = inj.t or 0
    hang = next((e for e in seen.events if e["event"] == "hang" and e["t"] >= t0), None)
    stacks = hang.get("stacks", []) if hang else []
    names = ", ".join(os.path.basename(s) for s in stacks)
    detail = f"{len(stacks)} written: {names}" if stacks else "no stack dump written"
    return Check("stack dumps", bool(stacks), detail)


def _quarantined(inj: Injection, seen: _Seen) -> Check:
    f = inj.facts
    prefix = f"corrupt-step-{int(f['corrupted_step']):08d}-"
    try:
        q = [n for n in os.listdir(seen.ckpt_root) if n.startswith(prefix)]
    except OSError:
        q = []
    where = f"moved to {q[0]}" if q else "the damaged checkpoint was not quarantined"
    return Check("quarantined", bool(q), f"{f['detail']} in {f['file']}; {where}")


def _waited_for_storage(inj: Injection, seen: _Seen) -> Check:
    f, t_fail = inj.facts, seen.fail["t"]
    until = float(f.get("outage_until", 0.0))
    early = [e for e in seen.events if e["event"] == "launch" and t_fail <= e["t"] <= until]
    n = int(f.get("failing_preflights", 0))
    how = (
        f"{len(early)} restart(s) while the storage was down"
        if early
        else "no restart until it was back"
    )
    return Check(
        "waited",
        not early and n >= 2,
        f"{n} failing pre-flights during the {until - t_fail:.1f} s outage, {how}",
    )


def _world_after(seen: _Seen) -> tuple[list[int], list[int]]:
    after = [
        int(r.get("world_size", 0))
        for r in seen.records
        if seen.restored is not None and r["step"] > seen.restored
    ]
    return after, sorted(set(after))


def _went_on_alone(inj: Injection, seen: _Seen) -> Check:
    after, sizes = _world_after(seen)
    return Check(
        "world size",
        bool(after) and sizes == [1],
        f"steps after the restore ran on world size(s) {sizes or 'none'}",
    )


def _went_on_elastic(inj: Injection, seen: _Seen) -> Check:
    # Going on alone and getting the node back are both correct elastic behaviour.
    after, sizes = _world_after(seen)
    how = "the node rejoined" if sizes and sizes[-1] > 1 else "went on without the node"
    return Check(
        "world size",
        bool(after),
        f"steps after the restore ran on world size(s) {sizes or 'none'} ({how})",
    )


def _tier_used(inj: Injection, seen: _Seen) -> Check:
    """The memory-tier faults: the restart restored from the tier the slots said it must
    (memory after a SIGKILL; the older slot or disk after a damaged slot; the peer replica
    after a node loss), losing at most K steps when memory was used (issue 25)."""
    f, t0 = inj.facts, inj.t or 0.0
    attempt = int(seen.fail["attempt"]) + 1
    loaded = [e for e in seen.events if e["event"] == "loaded" and e.get("attempt") == attempt]
    # a replacement node's ranks restore in its own first attempt: every one must agree
    loaded += [e for e in seen.joined if e["event"] == "loaded" and e["t"] >= t0]
    tiers = sorted({str(e.get("tier")) for e in loaded}) or ["none"]
    # the step the worker reached, as the supervisor saw it (its last beat): the injector's
    # beat can be a step behind the kill (the recovery record's steps_lost is the same)
    reached = seen.fail.get("step")
    lost = None if seen.restored is None or type(reached) is not int else reached - seen.restored
    ok = bool(loaded) and tiers == [f["tier"]] and seen.restored == inj.expected_restore
    ok = ok and all(e["t"] >= t0 and e.get("step") == seen.restored for e in loaded)
    if f["tier"] != "disk":
        ok = ok and lost is not None and 0 <= lost <= f["memory_every"]
    how = (
        f"restored step {seen.restored} from the {'/'.join(tiers)} tier on "
        f"{len(loaded)} rank{'s' if len(loaded) > 1 else ''}"
        if loaded
        else "no restore recorded (a fresh start)"
    )
    if "lost_node" in f:
        return Check("tier", ok, _node_loss_text(f, how, lost, ok))
    damaged = f"slot of step {f['damaged_step']} damaged; " if "damaged_step" in f else ""
    return Check(
        "tier",
        ok,
        f"{damaged}{how} (expected {f['tier']}: memory held {f['memory_steps']}, disk "
        f"{f['disk_step']}); steps lost {lost} (K = {f['memory_every']})",
    )


def _node_loss_text(f: dict[str, Any], how: str, lost: int | None, ok: bool) -> str:
    """The node-loss row: what the survivor held, what was restored, and why not the peer
    replica when it was not."""
    keeper, reps = f["report_node"], f["replica_steps"]
    kept = f"replica(s) of step(s) {reps}" if reps else "no complete replica"
    held = f"node {keeper} kept {kept}, own slots {f['memory_steps']}, disk {f['disk_step']}"
    text = f"node {f['lost_node']} lost; {how} (expected peer replica: {held}); steps lost "
    text += f"{lost} (K = {f['memory_every']})"
    if ok:
        return text
    if not reps:
        why = (
            f"node {keeper} held no replica of node {f['lost_node']}'s rank: the peer "
            "replica is off (CheckpointConfig(memory_replica=False), or "
            "$UNBROKEN_MEMORY_JUMP a multiple of the world size) or never completed a round"
        )
    elif f["replica_step"] is None:
        why = (
            f"node {keeper} held no replica of node {f['lost_node']}'s rank at a step of "
            "its own slots (one replica slot: ARCHITECTURE.md, the memory tier, 'Known gap')"
        )
    else:
        why = f"the replica of step {f['replica_step']} was not used"
    return f"{text}; {why}"


_SPECIFIC = {
    "kill-memory": _tier_used,
    "memory-damage": _tier_used,
    "node-loss": _tier_used,
    "kill-in-save": _debris_removed,
    "hang": _stacks_dumped,
    "corrupt": _quarantined,
    "storage": _waited_for_storage,
    "agent-loss": _went_on_elastic,
    "world-size": _went_on_alone,
}


# --- per run ------------------------------------------------------------------------------


def compare_run(
    run: str,
    ref_dir: str,
    job_dir: str,
    ckpt: str,
    metrics: str,
    world_reference: int,
    records: list[dict[str, Any]],
    may_differ: dict[str, str] | None = None,
) -> RunComparison:
    """The drilled run against its reference. When the world size changed, the floats are
    compared only up to the change (see the module doc of :mod:`unbroken.elastic.drill.runner`),
    and the final state's keys declared in ``may_differ`` (key -> why) are not compared."""
    from unbroken.ckpt.compare import compare_runs  # torch: imported only when a drill ends

    def verdict(exact_until: int | None, checks: list[Check], res: Any = None) -> RunComparison:
        result = plain_json(res, lossy=True) if res is not None else {}
        steps = len(records) if res is not None else 0
        return RunComparison(
            run, ref_dir, job_dir, world_reference, exact_until, checks, result, steps
        )

    if not records or "loss" not in records[0]:
        why = "is empty" if not records else "has no loss per step"
        fix = "log every step with MetricLog.log(step, loss=...[, ids=[sample ids of the step]])"
        return verdict(
            None, [Check("metric log", False, f"{os.path.join(job_dir, metrics)} {why}: {fix}")]
        )
    changed = next(
        (
            int(r["step"])
            for r in records
            if int(r.get("world_size", world_reference)) != world_reference
        ),
        None,
    )
    exact_until = None if changed is None else changed - 1
    try:
        res = compare_runs(ref_dir, job_dir, ckpt=ckpt, metrics=metrics, floats=changed is None)
    except (ValueError, OSError, KeyError) as e:
        return verdict(exact_until, [Check("final state", False, f"cannot compare: {e}")])
    checks = [
        _state_check(res, changed, may_differ or {}),
        _loss_check(res, len(records), world_reference, changed),
        _order_check(res, records),
        _duplicates_check(res),
    ]
    return verdict(exact_until, checks, res)


def _loss_check(res: dict[str, Any], steps: int, world: int, changed: int | None) -> Check:
    """The loss curve: identical (up to a world-size change at step ``changed``)."""
    d = res["first_loss_diff"]
    exact_until = None if changed is None else changed - 1
    if d is None:
        text = f"identical, {steps} steps"
    elif exact_until is not None and d > exact_until:
        text = (
            f"identical up to step {exact_until} (world size {world}); from "
            f"step {changed} on another world size: floats not compared bit for bit"
        )
    else:
        a, b = res["loss_at_diff"] or (None, None)
        text = f"differs from step {d}: reference {a!r}, drilled run {b!r}"
    return Check("loss curve", d is None or (exact_until is not None and d > exact_until), text)


def _order_check(res: dict[str, Any], records: list[dict[str, Any]]) -> Check:
    """The data order: the same sample ids, none missing, none twice (when ids are logged)."""
    n = res["first_sample_diff"]
    total = sum(len(r.get("ids", ())) for r in records)
    if not res["ids_logged"]:
        loaders = [p for p in _parts(res) if "loader" in p]
        text = "not checked: no sample ids logged (log ids=[...] each step to compare the order)"
        if loaders:
            text += f"; the loader's position ({', '.join(loaders)}) is compared in the final state"
        return Check("data order", True, text, skipped=True)
    if n is None:
        text = f"identical, {total} samples: none missing, none consumed twice"
    else:
        ra, rb = res["first_sample_ids"]
        text = (
            f"differs from sample #{n} (step {res['first_sample_step']}): reference id "
            f"{ra}, drilled run id {rb}; {res['missing_samples']} samples never consumed, "
            f"{res['extra_samples']} consumed too often"
        )
    return Check("data order", n is None, text, cause=f"other samples from sample #{n}")


def _duplicates_check(res: dict[str, Any]) -> Check:
    dup = res["duplicated_steps"]
    return Check(
        "metric log", dup == 0, "no duplicated step" if not dup else f"{dup} duplicated steps"
    )


_NOT_PARTS = {
    "counters",
    "scalar_diffs",
    "skipped_float_leaves",
    "duplicated_steps",
    "first_loss_diff",
    "loss_at_diff",
    "first_sample_diff",
    "first_sample_step",
    "first_sample_ids",
    "missing_samples",
    "extra_samples",
    "identical",
    "ids_logged",
}


def _parts(res: dict[str, Any]) -> list[str]:
    """The final state's components compared (``model``, ``optimizer``, ``loader``, ...)."""
    return sorted(k for k in res if k not in _NOT_PARTS)


def _declared(key: str, may_differ: dict[str, str]) -> str | None:
    """The declared key that covers leaf ``key`` (itself or a parent), if any."""
    k = key.strip("/")
    return next(
        (d for d in may_differ if k == d.strip("/") or k.startswith(d.strip("/") + "/")), None
    )


def _state_check(res: dict[str, Any], changed: int | None, may_differ: dict[str, str]) -> Check:
    """The final states identical; after a world-size change, keys the user declared may
    differ (``--may-differ KEY=WHY``) are left out, each named with its reason."""
    declared = may_differ if changed is not None else {}
    left_out: dict[str, str] = {}

    def keep(keys: list[str], part: str = "") -> list[str]:
        """``keys`` (of component ``part``) less those declared; those are remembered."""
        out = []
        for k in keys:
            d = _declared(part + k, declared)
            if d is None:
                out.append(k)
            else:
                left_out[(part + k).strip("/")] = declared[d]
        return out

    parts = _parts(res)
    res = {
        **res,
        **{p: keep(list(res[p]), p) for p in parts if res[p]},
        "counters": keep(list(res["counters"])),
        "scalar_diffs": {k: v for k, v in res["scalar_diffs"].items() if keep([k])},
    }
    bad = [p for p in parts if res[p]]
    if res["counters"]:
        bad.append("counters")
    why = "; ".join(f"{k}: {r}" for k, r in sorted(left_out.items()))
    if not bad:
        text = f"identical: {', '.join(parts)}, counters"
        if changed is not None:
            text += (
                f" (world size changed at step {changed}: {res['skipped_float_leaves']} "
                "float tensors not compared; integers, positions and schedules are)"
            )
        if why:
            text += f"; declared to differ after a resize, not compared: {why}"
        return Check("final state", True, text)
    items = []
    for p in bad:
        keys = res[p] if p != "counters" else res["counters"]
        items.append(
            f"{p} ({len(keys)}: {', '.join(k.lstrip('/') for k in keys[:3])}"
            f"{', ...' if len(keys) > 3 else ''})"
        )
    # Counters (step counts, last_epoch, positions) say most about what was not restored.
    ranked = sorted(res["scalar_diffs"].items(), key=lambda kv: (not _integral(kv[1]), kv[0]))
    scal = "; ".join(
        f"{k.lstrip('/')}: {a!r} in the reference, {b!r} here" for k, (a, b) in ranked[:5]
    )
    return Check(
        "final state", False, "differs in " + ", ".join(items) + (f"; {scal}" if scal else "")
    )


def unplanned_failures(injected: list[float], failures: list[tuple[str, dict[str, Any]]]) -> Check:
    """Every failure a supervisor recorded must follow an injected fault, at most one per
    node and fault: anything else (a spurious hang verdict, a restart that failed again) is
    a recovery the drill cannot vouch for."""
    seen: set[tuple[int, str]] = set()
    extra: list[str] = []
    reasons: list[str] = []
    for node, e in sorted(failures, key=lambda x: x[1]["t"]):
        i = sum(1 for t in injected if t <= e["t"]) - 1
        if i < 0 or (i, node) in seen:
            extra.append(
                f"node {node} at step {e.get('step')}: {e.get('fault')}/"
                f"{e.get('rule')} ({str(e.get('reason', ''))[:160]})"
            )
            reasons.append(str(e.get("reason", "")))
        seen.add((i, node))
    if extra:
        return Check(
            "failures",
            False,
            f"{len(extra)} failure(s) no injected fault explains: " + "; ".join(extra),
            # the job's own failure after a restore is the concrete cause (e.g. the metric
            # log refusing a step that went backwards: restore()'s step was ignored)
            cause=_cause_of(reasons[0]),
        )
    return Check("failures", True, f"{len(failures)} recorded, each after an injected fault")


def _cause_of(reason: str) -> str:
    """``rule: rank R: Error: message`` -> ``Error: message`` (the rank's own words)."""
    parts = reason.split(": ", 2)
    if len(parts) == 3 and parts[1].startswith("rank "):
        return f"{parts[2]} ({parts[1]})"
    return reason


def _integral(pair: Any) -> bool:
    return all(isinstance(v, int | float) and float(v).is_integer() for v in pair)


def diagnose(res: dict[str, Any], restored: int | None) -> str:
    """Guess what was not restored from where the runs part after a restore (used when the
    state audit cannot name it, see :func:`explain`)."""
    if res.get("first_sample_diff") is not None:
        ra, rb = res.get("first_sample_ids") or (None, None)
        return (
            "the data position was not restored: the resumed run consumed other samples "
            f"from sample #{res['first_sample_diff']} (step {res['first_sample_step']}) on: "
            f"id {rb} where the reference had {ra}"
        )
    d = res.get("first_loss_diff")
    if d is None or restored is None:
        return "the final state differs although the loss curve and the data order match"
    k = d - restored
    if k <= 0:
        return (
            f"the loss differs at step {d}, before the restored step {restored}: the "
            "metric log was not rolled back to the checkpoint"
        )
    if k == 1:
        return (
            f"the first step after restoring step {restored} already differs, on the same "
            "samples: state the forward pass uses was not restored (RNG streams such as "
            "dropout, or the model weights)"
        )
    if k == 2:
        return (
            f"step {restored + 1} after the restore matches but step {d} does not: the "
            "first optimizer update differs (optimizer state was not restored: moments, "
            "step counts or learning rate)"
        )
    return (
        f"steps {restored + 1}..{d - 1} after the restore match, step {d} does not: state "
        "that acts later was not restored (e.g. the learning-rate schedule)"
    )


# --- the state audit (see unbroken.common.audit) ----------------------------------------------


@dataclass
class AuditFinding:
    """What the state audit says about one restore (all ranks that recorded it)."""

    restored: int
    ranks: list[int]
    leaves: int
    """Leaves compared per rank (the largest count)."""
    restore_diff: dict[int, list[str]]
    """rank -> leaves whose restored value is not the value that rank saved."""
    from_rank0: dict[int, list[str]]
    """rank -> those of its differing leaves that hold rank 0's saved value instead."""
    step_diff: dict[int, list[str]] | None
    """rank -> leaves that differ from the reference one step after the restore, as
    ``kind:leaf`` (kinds of :func:`unbroken.common.audit._digest`); None: not compared."""
    note: str = ""


def _component(leaf: str) -> str:
    return leaf.split("/", 1)[0]


def _name_leaves(leaves: list[str], per: int = 3) -> str:
    """``extra.hidden (h/0), model (fc.weight, fc.bias)``: components, a few leaves each."""
    by: dict[str, list[str]] = {}
    for leaf in leaves:
        by.setdefault(_component(leaf), []).append(leaf.split("/", 1)[1] if "/" in leaf else "")
    parts = []
    for comp, keys in by.items():
        keys = [k for k in keys if k]
        shown = ", ".join(keys[:per]) + (", ..." if len(keys) > per else "")
        parts.append(f"{comp} ({shown})" if shown else comp)
    return ", ".join(parts)


def audit_restore(
    inj_t: float,
    restored: int,
    audit: dict[int, list[dict[str, Any]]],
    ref_audit: dict[int, list[dict[str, Any]]],
) -> AuditFinding | None:
    """Compare, per rank, the state right after the restore of step ``restored`` (the first
    one after ``inj_t``) with what that rank saved for that step, and the state one step
    later with the reference run's state at that step. None when nothing was recorded."""
    restore_diff: dict[int, list[str]] = {}
    from_rank0: dict[int, list[str]] = {}
    step_diff: dict[int, list[str]] = {}
    ranks: list[int] = []
    leaves = 0
    notes: set[str] = set()
    saved0: dict[str, Any] | None = None
    for rank in sorted(audit):
        recs = audit[rank]
        at = _restore_index(recs, restored, inj_t)
        if at is None:
            continue
        got = recs[at]
        saved = next(
            (r for r in reversed(recs[:at]) if r["event"] == "saved" and r["step"] == restored),
            None,
        )
        if saved is None:
            notes.add(f"no record of the save of step {restored} on rank {rank}")
            continue
        ranks.append(rank)
        a, b = _comparable(saved, got, notes)
        leaves = max(leaves, len(a))
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if rank == 0:
            saved0 = a
        if diff:
            restore_diff[rank] = diff
            if rank != 0 and saved0 is not None:
                same = [k for k in diff if b.get(k) is not None and b.get(k) == saved0.get(k)]
                if same:
                    from_rank0[rank] = same
        later = _step_after(recs[at + 1 :], got, a, ref_audit.get(rank, []), restored)
        if later is not None:
            step_diff[rank] = later
    if not ranks:
        return None
    return AuditFinding(
        restored,
        ranks,
        leaves,
        restore_diff,
        from_rank0,
        step_diff if step_diff else None,
        "; ".join(sorted(notes)),
    )


def _restore_index(recs: list[dict[str, Any]], restored: int, inj_t: float) -> int | None:
    """Where a rank's audit records the restore of ``restored`` after the injection."""
    return next(
        (
            i
            for i, r in enumerate(recs)
            if r["event"] == "restored" and r["step"] == restored and r["t"] >= inj_t
        ),
        None,
    )


def _comparable(
    saved: dict[str, Any], got: dict[str, Any], notes: set[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved and the restored leaves, without the RNG streams a world-size change
    re-derives by design."""
    a, b = saved["leaves"], got["leaves"]
    if saved["world"] != got["world"]:
        notes.add(f"world size {saved['world']} -> {got['world']}: RNG re-derived, not compared")
        a = {k: v for k, v in a.items() if not k.startswith("rng/")}
        b = {k: v for k, v in b.items() if not k.startswith("rng/")}
    return a, b


def _step_after(
    after: list[dict[str, Any]],
    got: dict[str, Any],
    saved: dict[str, Any],
    ref: list[dict[str, Any]],
    restored: int,
) -> list[str] | None:
    """``kind:leaf`` of the leaves that differ from the reference one step after the
    restore; None when either run did not record that step."""
    nxt = next((r for r in after if r["pid"] == got["pid"]), None)

    def ref_at(event: str, step: int) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in ref
                if r["event"] == event and r["step"] == step and r["world"] == got["world"]
            ),
            None,
        )

    there = ref_at("step", restored + 1)
    if nxt is None or nxt["event"] != "step" or nxt["step"] != restored + 1 or there is None:
        return None
    # Leaves that differ between the two runs already in the checkpoint both made of this
    # step (an RNG the script never seeds nor uses) say nothing about the restore.
    ref_saved = ref_at("saved", restored)
    e = ref_saved["leaves"] if ref_saved else {}
    noise = {k for k in saved.keys() | e.keys() if saved.get(k) != e.get(k)} if e else set()
    c, d = there["leaves"], nxt["leaves"]
    return sorted(
        f"{(d.get(k) or c.get(k) or '?:')[0]}:{k}"
        for k in c.keys() | d.keys()
        if c.get(k) != d.get(k) and k not in noise
    )


def restore_check(f: AuditFinding | None, restored: int | None) -> Check:
    """The fault's ``restore`` check: did restore() bring back exactly what was saved?"""
    if f is None:
        why = (
            "the job did not resume"
            if restored is None
            else "no state audit recorded for this restore (the state was not restored by "
            "unbroken's Checkpointer, or its save was not recorded)"
        )
        return Check("restore", True, f"not checked: {why}", skipped=True)
    if not f.restore_diff:
        rk = ", ".join(map(str, f.ranks))
        return Check(
            "restore",
            True,
            f"every leaf ({f.leaves}) of step {f.restored} came back "
            f"exactly as it was saved, on rank{'s' if len(f.ranks) > 1 else ''} {rk}"
            + (f" ({f.note})" if f.note else ""),
        )
    return Check("restore", False, _restore_text(f))


def _restore_text(f: AuditFinding) -> str:
    out = []
    for rank, diff in sorted(f.restore_diff.items()):
        text = f"on rank {rank}, {_name_leaves(diff)} not as saved"
        if f.from_rank0.get(rank):
            text += (
                f" (it holds rank 0's value of {_name_leaves(f.from_rank0[rank])}: state "
                "that differs between ranks was saved once, not per rank)"
            )
        out.append(text)
    return f"restore() did not bring back what was saved at step {f.restored}: " + "; ".join(out)


def explain(f: AuditFinding | None, res: dict[str, Any], restored: int | None) -> str:
    """The diagnosis of the fault whose recovery the runs part after: the component the state
    audit names, else :func:`diagnose`'s guess from where they part."""
    guess = diagnose(res, restored)
    if f is None or restored is None:
        return guess
    if f.restore_diff:
        return _restore_text(f)
    if f.step_diff is None:
        return guess + " (restore() itself brought back every leaf exactly)"
    leaves = sorted({k for d in f.step_diff.values() for k in d})
    causes = [k.split(":", 1)[1] for k in leaves if not k.startswith("f:")]
    floats = [k.split(":", 1)[1] for k in leaves if k.startswith("f:")]
    head = (
        f"restore() brought back every leaf of step {restored} exactly, but one step "
        f"later (step {restored + 1}) "
    )
    if causes:
        # The component with most differing discrete leaves first: the one that was reset
        # (an optimizer's step counts) ahead of what follows from it (a scheduler's last lr).
        count: dict[str, int] = {}
        for k in causes:
            count[_component(k)] = count.get(_component(k), 0) + 1
        comps = sorted(count, key=lambda c: (-count[c], c))
        causes.sort(key=lambda k: (comps.index(_component(k)), k))
        text = (
            head + f"{', '.join(comps)} differ{'s' if len(comps) == 1 else ''} from the "
            f"reference: {_name_leaves(causes)}; {'it was' if len(comps) == 1 else 'they were'} "
            "changed after restore() (re-seeded, re-created or reloaded by the script), or "
            "the step takes them from somewhere the checkpoint does not cover"
        )
        if res.get("first_sample_diff") is not None and "loader" in comps:
            text += f". {guess}"
        return text
    if floats:
        return (
            head + f"only computed values differ ({_name_leaves(floats)}): the step used "
            "state that is not in the checkpoint (a hidden state carried across batches, a "
            "module attribute, a global or a generator TrainState does not capture); "
            "register it with TrainState(extras={...})"
        )
    return guess + " (restore() brought back every leaf, and the state one step later matches)"


# --- per fault: what its recovery's steps show --------------------------------------------


def first_divergence(
    ref: list[dict[str, Any]], got: list[dict[str, Any]], exact_until: int | None
) -> tuple[int | None, str, bool]:
    """(first step where the logs part, what differs there, whether sample ids are compared).
    Steps are matched by number (the last record of a step counts); the loss is compared up
    to ``exact_until`` (None: everywhere), sample ids wherever both logs hold them."""
    a = {int(r["step"]): r for r in ref}
    b = {int(r["step"]): r for r in got}
    ids = bool(ref) and all("ids" in r for r in ref) and all("ids" in r for r in got)
    for s in sorted(a.keys() | b.keys()):
        x, y = a.get(s), b.get(s)
        if x is None:
            return s, f"step {s} is not in the reference's log", ids
        if y is None:
            return s, f"step {s} is missing from the drilled run's log", ids
        if ids and x["ids"] != y["ids"]:
            return s, f"other samples than the reference at step {s}", ids
        if (exact_until is None or s <= exact_until) and x.get("loss") != y.get("loss"):
            return s, f"the loss differs from step {s} on", ids
    return None, "", ids


def judge_trajectories(
    results: list[FaultResult],
    cmp: RunComparison,
    records: list[dict[str, Any]],
    ref_records: list[dict[str, Any]],
    findings: dict[int, AuditFinding | None] | None = None,
) -> None:
    """Add ``restore`` and ``trajectory`` checks to each fault of the run.

    A fault's recovery produced the steps from its restored step + 1 up to the step the next
    fault's recovery restored (the rest was rolled back) - those are what its trajectory
    check compares with the reference. The fault whose steps hold the first difference fails,
    with a diagnosis (:func:`explain`); faults after it say they were not checked.
    """
    findings = findings or {}
    mine = sorted(
        (r for r in results if r.injection.spec.run == cmp.run and r.injection.t is not None),
        key=lambda r: r.injection.spec.index,
    )
    for r in mine:
        r.checks.append(restore_check(findings.get(r.injection.spec.index), r.restored))
    d, what, ids = first_divergence(ref_records, records, cmp.exact_until)
    last = max([int(x["step"]) for x in records + ref_records], default=0)
    first_restore = mine[0].restored if mine else None
    if d is not None and first_restore is not None and d <= first_restore:
        cmp.checks.append(
            Check(
                "before any fault",
                False,
                f"{what}, before any fault's "
                "recovery: the training script is not deterministic (seeds, "
                "data order, nondeterministic kernels)",
            )
        )
    div = _Divergence(d, what, ids, last)
    culprit: FaultResult | None = None
    for i, r in enumerate(mine):
        later = mine[i + 1] if i + 1 < len(mine) else None
        check = _trajectory(r, later, div, culprit, cmp, findings)
        if not check.ok:
            culprit = r
        r.checks.append(check)


class _Divergence(NamedTuple):
    step: int | None
    """The first step where the drilled run's log parts from the reference's (None: never)."""
    what: str
    ids: bool
    last: int
    """The last step either log holds."""


def _trajectory(
    r: FaultResult,
    later: FaultResult | None,
    div: _Divergence,
    culprit: FaultResult | None,
    cmp: RunComparison,
    findings: dict[int, AuditFinding | None],
) -> Check:
    """Fault ``r``'s trajectory check: its steps (up to what ``later`` rolled back) against
    the reference; ``culprit``: the fault whose steps already diverged."""
    if r.restored is None:
        why = "not checked: the job did not resume (no restore recorded)"
        return Check("trajectory", True, why, skipped=True)
    a = r.restored + 1
    b = later.restored if later is not None and later.restored is not None else div.last
    if b < a:
        who = later.injection.spec.index if later else "?"
        why = (
            f"not checked: fault #{who} rolled the job back to step {b} before any step "
            "after this restore was kept"
        )
        return Check("trajectory", True, why, skipped=True)
    d = div.step
    if d is not None and d < a:
        where = (
            f" after fault #{culprit.injection.spec.index}'s recovery"
            if culprit
            else " before any fault's recovery"
        )
        why = f"not checked: the run had already diverged at step {d}{where}"
        return Check("trajectory", True, why, skipped=True)
    if d is not None and d <= b:
        why = explain(findings.get(r.injection.spec.index), cmp.result, r.restored)
        return Check(
            "trajectory", False, f"steps {a}..{b} compared: {div.what}; {why}", cause=div.what
        )
    if not div.ids and cmp.exact_until is not None and cmp.exact_until < b:
        # another world size and no sample ids: nothing of these steps can be compared
        span = f"step {a}" if a == b else f"steps {a}..{b}"
        why = (
            f"not checked: no sample ids logged, and {span} ran on another world size than "
            "the reference (floats not compared bit for bit); log ids=[...] each step"
        )
        return Check("trajectory", True, why, skipped=True)
    return Check("trajectory", True, _compared(a, b, div.ids, cmp.exact_until))


def _compared(a: int, b: int, ids: bool, exact_until: int | None) -> str:
    span = f"step {a}" if a == b else f"steps {a}..{b}"
    if exact_until is None or exact_until >= b:
        what = "loss and sample ids" if ids else "loss (no sample ids logged)"
        return f"{what} of {span} identical to the reference"
    if exact_until < a:
        return (
            f"sample ids of {span} identical to the reference (another world size from "
            f"step {exact_until + 1} on: floats not compared bit for bit)"
        )
    return (
        f"loss of steps {a}..{exact_until} and sample ids of {span} identical to the "
        f"reference (another world size from step {exact_until + 1} on)"
    )
