"""`unbroken drill`: kill a training job on purpose, every way it dies in production, and
prove that the resumed run is the run that was never interrupted.

    unbroken drill [options] -- train.py --out {dir} ...      # your script
    unbroken drill --example                                  # the demo model

:func:`run_drill` runs the command once without faults (the reference, in
``DRILL/reference-w1``, and on 2 ranks when a two-node fault is planned), then under
``unbroken run`` while a seeded schedule of faults (:mod:`.plan`: kill, kill-in-save, hang,
corrupt, storage, agent-loss, world-size; by name kill-memory, memory-damage, node-loss) is
injected one at a time (:mod:`.inject`), and judges every fault and the end state against the
reference (:mod:`.judge`, C-IDENTICAL, E-MEASURED); ``drill.txt``, ``drill.json`` and
``timeline.png`` land in DRILL. Every run it starts has ``UNBROKEN_STATE_AUDIT`` set
(:mod:`unbroken.common.audit`).

What the script must do: README, "What unbroken drill needs from your script". The fault
kinds, what is compared (and how after a world-size change) and the drill directory's
layout: ARCHITECTURE.md, "Design notes" > elastic > the drill.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from unbroken.ckpt.memtier import ENV as ENV_MEMORY_TIER
from unbroken.common import events
from unbroken.common.audit import ENV_AUDIT, read_audit
from unbroken.common.fs import private_dir
from unbroken.common.metrics import read_metrics
from unbroken.common.procs import kill_matching
from unbroken.elastic.drill.inject import Ctx, Node, inject
from unbroken.elastic.drill.judge import (
    FaultResult,
    RunComparison,
    audit_restore,
    compare_run,
    evaluate_fault,
    judge_trajectories,
    unplanned_failures,
)
from unbroken.elastic.drill.plan import (
    ALL_KINDS,
    ELASTIC_KINDS,
    FAULT_KINDS,
    MEMORY_KINDS,
    NODES_KINDS,
    SINGLE_KINDS,
    FaultSpec,
    Injection,
    plan_faults,
)
from unbroken.elastic.drill.report import DrillReport
from unbroken.elastic.rendezvous import reserved_port

__all__ = [
    "ENV_TOKEN",
    "DrillConfig",
    "example_config",
    "run_drill",
    "run_reference",
]

log = logging.getLogger(__name__)

ENV_TOKEN = "UNBROKEN_DRILL_TOKEN"
"""Every process a drill starts inherits this; cleanup kills whatever still carries it."""

_DRILL_FILES = ("drill.txt", "drill.json", "timeline.png")
_RUNS = ("single", "elastic", "nodes")
"""The drilled runs, in this order (:attr:`.plan.FaultSpec.run`)."""
_REF_SUFFIXES = ("", ".log", ".torchrun", ".audit")
_CHILD_ENV_DROP = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    events.ENV_RUN_DIR,
    events.ENV_ATTEMPT,
    events.ENV_CATCHUP,
    ENV_AUDIT,
    # each node of a drilled run has the memory directory its own supervisor creates: one
    # named for all would put two "nodes" in one /dev/shm and hide a node loss
    ENV_MEMORY_TIER,
)


@dataclass(frozen=True)
class DrillConfig:
    command: tuple[str, ...]
    """The training script (or module with ``module``) and its arguments; ``{dir}`` in them
    is replaced by each run's own directory."""
    drill_dir: str = "unbroken-drill"
    module: bool = False
    faults: tuple[str, ...] | None = None
    """Fault kinds to inject (see the module doc); None: every kind that applies."""
    seed: int = 0
    """Seeds the schedule: kinds' order, steps, victims, corrupted file and byte."""
    multi_rank: bool = False
    """The script trains on 2 ranks and resumes on another world size (enables
    ``agent-loss`` and ``world-size``)."""
    ckpt_subdir: str = "ckpt"
    """The Checkpointer root, relative to ``{dir}``."""
    metrics_file: str = "metrics.jsonl"
    """The MetricLog file, relative to ``{dir}``."""
    ckpt_every: int | None = None
    """Steps between checkpoints (None: inferred from the reference's checkpoints)."""
    hang_timeout: float = 60.0
    """The supervisor's ``--hang-timeout`` (seconds): must exceed the longest step + save."""
    outage: float = 2.0
    """Seconds the checkpoint directory stays unreachable, at least (and until the
    supervisor's pre-flight failed twice)."""
    timeout: float = 900.0
    """Seconds each run (reference or drilled) may take before the drill gives up."""
    reference: str | None = None
    """A finished 1-rank reference run of the same command to reuse (its ``{dir}``)."""
    reference_w2: str | None = None
    """A finished 2-rank reference run of the same command to reuse (its ``{dir}``, e.g.
    ``DRILL/reference-w2`` of an earlier drill), for the two-node faults."""
    supervisor_args: tuple[str, ...] = ()
    """Extra ``unbroken run`` options for the drilled runs."""
    may_differ: tuple[tuple[str, str], ...] = ()
    """``(key, why)``: final-state keys (``values/best_val_loss``, a component name) that
    may differ after a world-size change (e.g. computed on RNG streams re-derived for the
    new ranks); left out of the comparison after a resize, each named with its reason."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError(
                "no training command: use `unbroken drill [options] -- train.py "
                "ARGS` (with {dir} in ARGS) or `unbroken drill --example`"
            )
        if not any("{dir}" in a for a in self.command):
            raise ValueError(
                f"the command {' '.join(self.command)!r} has no {{dir}}: the drill runs it "
                "several times and must tell each run where to write; put {dir} where the "
                "script takes its output directory, e.g. `-- train.py --out {dir}`"
            )
        unknown = sorted(set(self.faults or ()) - set(ALL_KINDS))
        if unknown:
            raise ValueError(f"unknown fault kind(s) {unknown}; choose from {', '.join(ALL_KINDS)}")
        if self.faults is not None and not self.faults:
            raise ValueError("faults is empty; pass at least one kind or None for all")
        need = sorted(set(self.faults or ()) & set(ELASTIC_KINDS + NODES_KINDS))
        if need and not self.multi_rank:
            raise ValueError(
                f"fault(s) {need} run the script on 2 ranks (one per node) and lose a "
                "node; pass --multi-rank if it supports that"
            )
        for name in ("hang_timeout", "outage", "timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.ckpt_every is not None and self.ckpt_every < 1:
            raise ValueError(f"ckpt_every={self.ckpt_every} must be >= 1")
        for key, why in self.may_differ:
            if not key.strip("/") or not why.strip():
                raise ValueError(
                    f"may_differ ({key!r}, {why!r}): name the key and say why it may differ, "
                    "e.g. --may-differ 'values/best_val_loss=eval batches drawn per rank'"
                )

    @property
    def kinds(self) -> tuple[str, ...]:
        if self.faults is not None:
            return tuple(k for k in ALL_KINDS if k in self.faults)
        return FAULT_KINDS if self.multi_rank else SINGLE_KINDS


def example_config(
    drill_dir: str = "unbroken-drill",
    *,
    steps: int = 50,
    seed: int = 0,
    extra: tuple[str, ...] = (),
    **kwargs: Any,
) -> DrillConfig:
    """The drill on the demo model (``python -m unbroken.demo.train``): 8-sample
    micro-batches, a checkpoint every 5 steps, a 4 s hang timeout. ``extra`` goes to the
    demo script (e.g. ``("--break", "rng")`` plants a resume bug)."""
    cmd = (
        "unbroken.demo.train",
        "--dir",
        "{dir}",
        "--steps",
        str(steps),
        "--seed",
        "0",
        "--ckpt-every",
        "5",
        "--batch",
        "8",
        *extra,
    )
    kwargs.setdefault("hang_timeout", 4.0)
    kwargs.setdefault("multi_rank", True)
    return DrillConfig(cmd, drill_dir, module=True, seed=seed, ckpt_every=5, **kwargs)


# --- processes ----------------------------------------------------------------------------


def _child_env(token: str, audit: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CHILD_ENV_DROP}
    env[ENV_TOKEN] = token
    env["PYTHONUNBUFFERED"] = "1"
    if audit:
        env[ENV_AUDIT] = audit  # the Checkpointer records state fingerprints there
    return env


def _audit_dir(run_dir: str) -> str:
    """Where the state audit of the run whose ``{dir}`` is ``run_dir`` goes (beside it)."""
    return os.path.abspath(run_dir).rstrip("/") + ".audit"


def _fill(command: tuple[str, ...], run_dir: str) -> list[str]:
    return [a.replace("{dir}", run_dir) for a in command]


def run_reference(
    cfg: DrillConfig, out_dir: str, world: int = 1, *, token: str | None = None
) -> float:
    """Run the command once without faults on ``world`` ranks (``torchrun --standalone``)
    with ``{dir}`` = ``out_dir``; returns seconds. Raises RuntimeError naming the log."""
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(_audit_dir(out_dir), ignore_errors=True)
    os.makedirs(out_dir)
    log_path = out_dir.rstrip("/") + ".log"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--log-dir",
        out_dir.rstrip("/") + ".torchrun",
    ]
    if cfg.module:
        argv.append("-m")
    argv += _fill(cfg.command, os.path.abspath(out_dir))
    token = token or uuid.uuid4().hex
    t0 = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=_child_env(token, _audit_dir(out_dir)),
        )
        try:
            rc = proc.wait(timeout=cfg.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_matching(ENV_TOKEN, token, timeout=10.0)
    if rc != 0:
        with open(log_path, "rb") as f:
            tail = f.read()[-3000:].decode("utf-8", "replace")
        why = f"timed out after {cfg.timeout:g} s" if rc is None else f"exited {rc}"
        raise RuntimeError(f"the reference run ({world} rank(s)) {why}; see {log_path}:\n{tail}")
    return time.monotonic() - t0


def _infer_schedule(cfg: DrillConfig, ref_dir: str) -> tuple[int, int]:
    recs = read_metrics(os.path.join(ref_dir, cfg.metrics_file))
    if not recs:
        raise RuntimeError(
            f"the reference run logged no steps to {ref_dir}/{cfg.metrics_file};"
            " the script must log every step with unbroken.common.metrics.MetricLog"
        )
    steps = int(recs[-1]["step"])
    if cfg.ckpt_every is not None:
        return steps, cfg.ckpt_every
    from unbroken.ckpt.store import Store

    # Every save the reference made (the state audit records them; retention has deleted
    # most of their directories), else the checkpoints that are left.
    audit = read_audit(_audit_dir(ref_dir)).get(0, [])
    saved = {int(r["step"]) for r in audit if r["event"] == "saved"}
    saved = saved or set(Store(os.path.join(ref_dir, cfg.ckpt_subdir)).steps())
    where = os.path.join(ref_dir, cfg.ckpt_subdir)
    if not saved:
        raise RuntimeError(
            f"the reference run saved no checkpoint into {where}: the drill kills the job "
            "and resumes it from its checkpoints. Have the script save with unbroken's "
            f"Checkpointer into {{dir}}/{cfg.ckpt_subdir} (Checkpointer(..., every_steps=N) "
            "and ckpt.maybe_save() every step, a final save at the last), or name the "
            "directory it saves into with --ckpt-subdir"
        )
    regular = sorted(s for s in saved if s != steps)
    if not regular:
        raise RuntimeError(
            f"cannot infer the checkpoint interval from {where}: the reference run saved "
            f"only its last step ({steps}); save every N steps (every_steps=N and "
            "ckpt.maybe_save() each step), or pass --ckpt-every N"
        )
    return steps, math.gcd(*regular)


def _supervisor_argv(
    cfg: DrillConfig,
    sup_dir: str,
    ckpt: str,
    command: list[str],
    n_faults: int,
    node: tuple[int, str, str] | None,
) -> list[str]:
    """``unbroken run`` for one node: ``node`` is (rendezvous port, node name, ``--nnodes``)
    for the two-node runs, None for the one-node run."""
    argv = [
        sys.executable,
        "-m",
        "unbroken.cli",
        "run",
        "--run-dir",
        sup_dir,
        "-q",
        "--poll-interval",
        "0.1",
        "--hang-timeout",
        f"{cfg.hang_timeout:g}",
        "--dump-grace",
        "1.5",
        "--backoff",
        "0.2",
        "--backoff-max",
        "1",
        # A fall-back to an older checkpoint (corrupt) is a restart without progress.
        "--max-restarts",
        str(n_faults + 3),
        "--no-progress-limit",
        str(n_faults + 2),
        "--ckpt-dir",
        ckpt,
        "--preflight-timeout",
        "10",
        "--preflight-max-wait",
        f"{max(120.0, 4 * cfg.outage):g}",
        "--node-timeout",
        "2",
        "--last-call-timeout",
        "3",
        "--join-timeout",
        "120",
        "--shutdown-timeout",
        "10",
    ]
    if node is not None:
        port, name, nnodes = node
        argv += [
            "--nnodes",
            nnodes,
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--run-id",
            "drill",
            "--node",
            name,
        ]
    argv += list(cfg.supervisor_args)
    if cfg.module:
        argv.append("-m")
    return [*argv, "--", *command]


@dataclass
class _Run:
    name: str
    job: str
    ckpt: str
    ctx: Ctx
    injections: list[Injection]


def _drilled_run(cfg: DrillConfig, name: str, specs: list[FaultSpec], env: dict[str, str]) -> _Run:
    base = os.path.join(cfg.drill_dir, name)
    job = os.path.abspath(os.path.join(base, "job"))
    os.makedirs(job)
    ckpt = os.path.join(job, cfg.ckpt_subdir)
    command = _fill(cfg.command, job)
    env = {**env, ENV_AUDIT: _audit_dir(job)}
    hold = contextlib.ExitStack()  # the two-node runs' rendezvous port, held to the end
    port = None if name == "single" else hold.enter_context(reserved_port())
    # the elastic run may shrink to one node; the nodes run waits for a replacement
    nnodes = "2" if name == "nodes" else "1:2"

    def start(n: str) -> Node:
        sup = os.path.abspath(os.path.join(base, f"node-{n}"))
        rdzv = None if port is None else (port, n, nnodes)
        return Node(n, sup, _supervisor_argv(cfg, sup, ckpt, command, len(specs), rdzv), env)

    nodes = [start(n) for n in (["A"] if port is None else ["A", "B"])]
    ctx = Ctx(nodes, ckpt, time.monotonic() + cfg.timeout, cfg.outage, world=len(nodes))
    ctx.start_node = start
    run = _Run(name, job, ckpt, ctx, [])
    since, floor = 0.0, 0
    try:
        for spec in specs:
            # Never hit the same step twice: the supervisor would take two identical
            # failures at one step for a deterministic bug and stop.
            eff = replace(spec, step=max(spec.step, floor + 2))
            inj = inject(eff, ctx, since)
            run.injections.append(inj)
            if inj.t is None:
                break
            log.info("drill: fault #%d %s: %s", spec.index, spec.kind, inj.detail)
            if spec.kind != "storage":  # the storage injector waited for it already
                try:
                    ctx.wait_failure(ctx.node(inj.report_node), inj.t)
                except (TimeoutError, RuntimeError) as e:
                    inj.error = f"no failure recorded: {e}"
                    break
            since, floor = inj.t, inj.step or floor
        while any(n.running for n in ctx.nodes) and time.monotonic() < ctx.deadline:
            ctx.beats(since)  # keeps sampling progress for the timeline
            time.sleep(0.05)
    finally:
        for n in ctx.nodes:  # with a replacement node a fault started
            if n.running:
                log.error("drill: node %s still running at the end; killing it", n.name)
                n.kill()
            n.close()
        hold.close()
    return run


# --- the drill ----------------------------------------------------------------------------


def _prepare(cfg: DrillConfig) -> None:
    d = cfg.drill_dir
    if os.path.isdir(d) and os.listdir(d):
        ours = {f"{r}{x}" for r in ("reference-w1", "reference-w2") for x in _REF_SUFFIXES} | {
            *_RUNS,
            *_DRILL_FILES,
        }
        if not os.path.exists(os.path.join(d, "drill.json")) and not set(os.listdir(d)) <= ours:
            raise ValueError(
                f"{d!r} exists and is not a drill directory; pass another --dir or remove it"
            )
    keep = {
        os.path.abspath(r).rstrip("/") + x
        for r in (cfg.reference, cfg.reference_w2)
        if r
        for x in _REF_SUFFIXES
    }
    names = [f"{r}{x}" for r in ("reference-w1", "reference-w2") for x in _REF_SUFFIXES]
    for name in (*names, *_RUNS, *_DRILL_FILES):
        p = os.path.abspath(os.path.join(d, name))
        if p in keep:
            continue
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.unlink(p)
    private_dir(d, purpose="drill directory")  # it holds the drilled runs' run directories


def _reference(cfg: DrillConfig, world: int, reuse: str | None, token: str) -> str:
    """The ``world``-rank reference run's ``{dir}``: ``reuse`` when given, else run now."""
    if reuse:
        log.info("drill: reusing the %d-rank reference run in %s", world, reuse)
        return os.path.abspath(reuse)
    out = os.path.abspath(os.path.join(cfg.drill_dir, f"reference-w{world}"))
    log.info("drill: reference run (%d rank(s), no faults) in %s", world, out)
    run_reference(cfg, out, world, token=token)
    return out


def run_drill(cfg: DrillConfig, *, token: str | None = None) -> DrillReport:
    """Run the whole drill (reference runs, drilled runs, comparison) and write the report.

    Every process it starts carries ``UNBROKEN_DRILL_TOKEN=token`` (default: a fresh one)
    and is killed before this returns, also on errors and interrupts.
    """
    _prepare(cfg)
    token = token or uuid.uuid4().hex
    env = _child_env(token)
    t0 = time.monotonic()
    kinds = cfg.kinds
    refs: dict[int, str] = {}
    runs: list[_Run] = []
    notes: list[str] = []
    try:
        if any(k in SINGLE_KINDS + MEMORY_KINDS and k not in NODES_KINDS for k in kinds):
            refs[1] = _reference(cfg, 1, cfg.reference, token)
        if any(k in ELASTIC_KINDS + NODES_KINDS for k in kinds):
            refs[2] = _reference(cfg, 2, cfg.reference_w2, token)
        steps, every = _infer_schedule(cfg, refs[min(refs)])
        plan = plan_faults(kinds, steps, every, cfg.seed)
        log.info(
            "drill: plan (seed %d): %s",
            cfg.seed,
            ", ".join(f"#{p.index} {p.kind}@{p.step}" for p in plan),
        )
        for name in _RUNS:
            specs = [p for p in plan if p.run == name]
            if specs:
                log.info("drill: %s run under `unbroken run` with %d fault(s)", name, len(specs))
                runs.append(_drilled_run(cfg, name, specs, env))
    finally:
        kill_matching(ENV_TOKEN, token, timeout=10.0)
    if not cfg.multi_rank and cfg.faults is None:
        notes.append(
            "agent-loss and world-size were not run: they need a script that trains "
            "on 2 ranks (pass --multi-rank if yours does)"
        )
    report = _evaluate(cfg, plan, runs, refs, notes)
    report.wall = time.monotonic() - t0
    _plot(report, runs, refs, cfg)
    report.write()
    return report


def _evaluate(
    cfg: DrillConfig,
    plan: list[FaultSpec],
    runs: list[_Run],
    refs: dict[int, str],
    notes: list[str],
) -> DrillReport:
    results: list[FaultResult] = []
    comps: list[RunComparison] = []
    exits: dict[str, int | None] = {}
    for run in runs:
        mine, cmp = _judge_run(cfg, run, refs)
        results += mine
        comps.append(cmp)
        lost = {i.facts.get("lost_node") for i in run.injections}
        for n in run.ctx.nodes:
            exits[f"{run.name}/{n.name}"] = None if n.name in lost else n.proc.returncode
        if cmp.exact_until is not None:
            notes.append(
                f"{run.name} run: from step {cmp.exact_until + 1} on, the job ran on another "
                "world size than its reference: gradients are all-reduced over another number "
                "of ranks and round differently, so floats are not expected to be bit-identical. "
                "Compared exactly instead: every sample id in order, the loss curve up to step "
                f"{cmp.exact_until}, and the final state's non-float-tensor leaves."
            )
    injected = {(i.injection.spec.index) for i in results}
    for p in plan:  # faults never reached (the run before them failed)
        if p.index not in injected:
            inj = Injection(p, error="not reached: an earlier fault's run ended the drill")
            results.append(evaluate_fault(inj, [], "", []))
    results.sort(key=lambda r: r.injection.spec.index)
    return DrillReport(
        os.path.abspath(cfg.drill_dir),
        list(cfg.command),
        cfg.seed,
        plan,
        results,
        comps,
        exits,
        notes=notes,
    )


def _judge_run(
    cfg: DrillConfig, run: _Run, refs: dict[int, str]
) -> tuple[list[FaultResult], RunComparison]:
    """Each fault of one drilled run, and the run against its reference."""
    records = read_metrics(os.path.join(run.job, cfg.metrics_file))
    ts = [i.t for i in run.injections[1:]] + [None]
    mine = [
        evaluate_fault(
            inj,
            run.ctx.node(inj.report_node).events(fresh=True),
            run.ckpt,
            records,
            until,
            run.ctx.node(inj.facts["replacement"]).events(fresh=True)
            if "replacement" in inj.facts
            else None,
        )
        for inj, until in zip(run.injections, ts, strict=True)
    ]
    world = 1 if run.name == "single" else 2
    cmp = compare_run(
        run.name,
        refs[world],
        run.job,
        cfg.ckpt_subdir,
        cfg.metrics_file,
        world,
        records,
        dict(cfg.may_differ),
    )
    audit, ref_audit = read_audit(_audit_dir(run.job)), read_audit(_audit_dir(refs[world]))
    findings = {
        r.injection.spec.index: audit_restore(r.injection.t or 0.0, r.restored, audit, ref_audit)
        for r in mine
        if r.restored is not None
    }
    ref_records = read_metrics(os.path.join(refs[world], cfg.metrics_file))
    judge_trajectories(mine, cmp, records, ref_records, findings)
    failures = [
        (n.name, e) for n in run.ctx.nodes for e in n.events(fresh=True) if e["event"] == "failure"
    ]
    cmp.checks.append(
        unplanned_failures([i.t for i in run.injections if i.t is not None], failures)
    )
    return mine, cmp


def _plot(report: DrillReport, runs: list[_Run], refs: dict[int, str], cfg: DrillConfig) -> None:
    from unbroken.elastic.drill.plot import plot_timeline

    panels = []
    for run in runs:
        t0 = min(n.t_start for n in run.ctx.nodes)
        recs = read_metrics(os.path.join(run.job, cfg.metrics_file))
        ref = read_metrics(os.path.join(refs[1 if run.name == "single" else 2], cfg.metrics_file))
        mine = [f for f in report.faults if f.injection.spec.run == run.name]
        panels.append(
            {
                "title": f"{run.name} run: steps over time, faults (black) and recovery phases",
                "t0": t0,
                "progress": run.ctx.progress,
                "reference": [(float(r["time"]), int(r["step"])) for r in ref],
                "ref_offset": float(recs[0]["time"]) - t0 if recs else 0.0,
                "faults": [
                    (f.injection.t, f"#{f.injection.spec.index} {f.injection.spec.kind}")
                    for f in mine
                    if f.injection.t is not None
                ],
                "recoveries": [f.recovery for f in mine if f.recovery],
            }
        )
    if not panels:
        report.notes.append("no timeline.png: no drilled run got far enough to draw")
        return
    path = plot_timeline(os.path.join(cfg.drill_dir, "timeline.png"), panels)
    if path:
        report.files["timeline"] = os.path.abspath(path)
    else:
        report.notes.append(
            "no timeline.png: matplotlib is not installed (pip install 'unbroken[plot]')"
        )
