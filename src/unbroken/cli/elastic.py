"""``unbroken run | preflight | report | plan | drill``: the job's lifeline.

The flags of ``run`` and ``preflight`` that mirror a field of the supervisor's config
dataclasses are generated from them (:data:`RUN_FLAGS`, :data:`PREFLIGHT_FLAGS`): their
defaults are the dataclasses' defaults, and :func:`run_config` / :func:`preflight_config`
build the dataclasses by keyword.
"""

from __future__ import annotations

import argparse

from unbroken.cli._args import (
    ConfigFlag,
    Sub,
    add_command,
    add_config_flags,
    at_least,
    byte_count,
    config_kwargs,
    host_port,
)
from unbroken.elastic.faults import RestartPolicy, Rule
from unbroken.elastic.preflight import PreflightConfig
from unbroken.elastic.rendezvous import RendezvousConfig
from unbroken.elastic.supervisor import RunConfig, WatchdogConfig

__all__ = ["PREFLIGHT_FLAGS", "RUN_FLAGS", "add_elastic", "preflight_config", "run_config"]

F = ConfigFlag

RUN_FLAGS: tuple[ConfigFlag, ...] = (
    F(
        ("--run-dir",),
        RunConfig,
        "run_dir",
        "events.jsonl, recovery.jsonl, logs, beats, stack dumps go here",
    ),
    F(("--nnodes",), RendezvousConfig, "nnodes", "N or MIN:MAX nodes"),
    F(("--nproc-per-node",), RunConfig, "nproc_per_node", "workers per node", type=at_least(1)),
    F(("-m", "--module"), RunConfig, "module", "SCRIPT is a module name", action="store_true"),
    F(
        ("--rdzv-endpoint",),
        RendezvousConfig,
        "endpoint",
        "HOST:PORT of the rendezvous store, hosted by the supervisor on HOST (port 0: a free "
        "port; multi-node needs a fixed port)",
        type=host_port,
    ),
    F(("--run-id",), RendezvousConfig, "run_id", "job name shared by all nodes"),
    F(("--node",), RendezvousConfig, "node", "this node's name", shown="HOSTNAME-PID"),
    F(("--max-restarts",), RestartPolicy, "max_restarts", "restart budget", type=at_least(0)),
    F(
        ("--backoff",),
        RestartPolicy,
        "backoff_initial",
        "seconds before the first restart, doubled per restart without progress",
        unit=" s",
    ),
    F(("--backoff-max",), RestartPolicy, "backoff_max", "backoff cap", unit=" s"),
    F(
        ("--no-progress-limit",),
        RestartPolicy,
        "no_progress_limit",
        "stop after N restarts in a row without a newer checkpoint",
    ),
    F(
        ("--hang-timeout",),
        WatchdogConfig,
        "hang_timeout",
        "seconds without a beat before the workers count as hung",
        unit=" s",
    ),
    F(
        ("--startup-timeout",),
        WatchdogConfig,
        "startup_timeout",
        "seconds from heartbeat.install() to the first beat",
        unit=" s",
    ),
    F(("--poll-interval",), WatchdogConfig, "poll_interval", "watchdog period", unit=" s"),
    F(
        ("--dump-grace",),
        WatchdogConfig,
        "dump_grace",
        "seconds hung workers get to write stack dumps",
        unit=" s",
    ),
    F(("--ckpt-dir",), PreflightConfig, "ckpt_dir", "checkpoint root to probe in pre-flight"),
    F(
        ("--data",),
        PreflightConfig,
        "data",
        "dataset dir or dataset.json to validate in pre-flight",
    ),
    F(
        ("--min-free-bytes",),
        PreflightConfig,
        "min_free_bytes",
        "free space needed before the first checkpoint (a size: 512MiB, 10GB)",
        type=byte_count,
        unit=" bytes",
    ),
    F(
        ("--preflight-timeout",),
        PreflightConfig,
        "timeout",
        "seconds per pre-flight probe before it counts as hung",
        unit=" s",
    ),
    F(
        ("--preflight-max-wait",),
        RunConfig,
        "preflight_max_wait",
        "wait this long for a healthy pre-flight, then exit 6",
        unit=" s",
    ),
    F(
        ("--last-call-timeout",),
        RendezvousConfig,
        "last_call_timeout",
        "after MIN nodes joined, wait this long for more",
        unit=" s",
    ),
    F(
        ("--join-timeout",),
        RendezvousConfig,
        "join_timeout",
        "rendezvous must reach MIN nodes within this",
        unit=" s",
    ),
    F(
        ("--node-timeout",),
        RendezvousConfig,
        "node_timeout",
        "a peer supervisor silent this long counts as a lost node",
        unit=" s",
    ),
    F(
        ("--shutdown-timeout",),
        RunConfig,
        "shutdown_timeout",
        "on SIGTERM, seconds the job gets to save before it is killed; also the time a "
        "worker that said its loop ended (finishing()) gets to save and exit (at least "
        "--hang-timeout)",
        unit=" s",
    ),
    F(
        ("--stop-grace",),
        RunConfig,
        "stop_grace",
        "when a rank fails, seconds the other ranks get to exit before they are killed: they "
        "cannot finish a collective with it",
        unit=" s",
    ),
    F(
        ("--no-prewarm",),
        RunConfig,
        "prewarm",
        "hold no fork server ahead: the next attempt's agent is started ahead bare (torch "
        "imported, about half the standby's memory) and forks the restarted workers from "
        "its own imports at the restart (see --no-standby for fresh interpreters)",
        action="store_false",
    ),
    F(
        ("--standby-start",),
        RunConfig,
        "standby_start",
        "when the next attempt's standby starts: launch (with the attempt), beat (once "
        "every local rank has beaten: never competes with the attempt's start-up), auto "
        "(launch when the node has nproc-per-node + 4 CPUs, else beat)",
    ),
    F(
        ("--no-standby",),
        RunConfig,
        "standby",
        "hold nothing for the next attempt while the job trains (the standby costs a few "
        "hundred MB and a few CPU-seconds per attempt); workers start as fresh interpreters, "
        "restarted in the running agent after a rank's failure, and a lost agent costs a "
        "fresh one",
        action="store_false",
    ),
    F(("-q", "--quiet"), RunConfig, "echo", "do not echo the job's output", action="store_false"),
)
"""The flags of ``unbroken run`` that set one field of the supervisor's configs."""

PREFLIGHT_FLAGS: tuple[ConfigFlag, ...] = (
    F(
        ("--ckpt-dir",),
        PreflightConfig,
        "ckpt_dir",
        "checkpoint root: reachable, writable, free space",
    ),
    F(("--data",), PreflightConfig, "data", "dataset dir or dataset.json: present and valid"),
    F(
        ("--rdzv-endpoint",),
        PreflightConfig,
        "rdzv_endpoint",
        "HOST:PORT that must accept connections",
        type=host_port,
    ),
    F(
        ("--nproc-per-node",),
        PreflightConfig,
        "gpus",
        "GPUs needed when CUDA is present",
        type=at_least(1),
    ),
    F(
        ("--min-free-bytes",),
        PreflightConfig,
        "min_free_bytes",
        "free space the checkpoint root needs (a size: 512MiB, 10GB)",
        type=byte_count,
        unit=" bytes",
    ),
    F(
        ("--gpu-min-free",),
        PreflightConfig,
        "gpu_min_free_fraction",
        "fraction of each GPU's memory that must be free",
    ),
    F(("--timeout",), PreflightConfig, "timeout", "seconds per probe", unit=" s"),
)
"""The flags of ``unbroken preflight``, each one field of :class:`PreflightConfig`."""


def _command(a: argparse.Namespace) -> tuple[str, ...]:
    return tuple(a.command[1:] if a.command[:1] == ["--"] else a.command)


def run_config(a: argparse.Namespace) -> RunConfig:
    """The supervisor's config from ``unbroken run``'s parsed flags (by keyword)."""
    from unbroken.elastic import faults
    from unbroken.elastic.launch.attempt import DEFAULT_PRELOAD

    return RunConfig(
        command=_command(a),
        rdzv=RendezvousConfig(**config_kwargs(RendezvousConfig, RUN_FLAGS, a)),
        watchdog=WatchdogConfig(**config_kwargs(WatchdogConfig, RUN_FLAGS, a)),
        policy=RestartPolicy(**config_kwargs(RestartPolicy, RUN_FLAGS, a)),
        preflight=PreflightConfig(**config_kwargs(PreflightConfig, RUN_FLAGS, a)),
        preload=(*DEFAULT_PRELOAD, *a.preload),
        rules=(*(_rule(r) for r in a.fault_rule), *faults.DEFAULT_RULES),
        torchrun_args=tuple(a.torchrun_arg),
        **config_kwargs(RunConfig, RUN_FLAGS, a),
    )


def _rule(spec: str) -> Rule:
    """``--fault-rule CLASS=REGEX``; a refusal names the option and the value given."""
    from unbroken.elastic import faults

    try:
        return faults.parse_rule(spec)
    except ValueError as e:
        if str(e).startswith("--fault-rule"):
            raise
        raise ValueError(f"--fault-rule {spec!r}: {e}") from None


def preflight_config(a: argparse.Namespace) -> PreflightConfig:
    """:class:`PreflightConfig` from ``unbroken preflight``'s parsed flags (by keyword)."""
    return PreflightConfig(**config_kwargs(PreflightConfig, PREFLIGHT_FLAGS, a))


# --- run, preflight ------------------------------------------------------------------------


def _run(a: argparse.Namespace) -> int:
    from unbroken.elastic.supervisor import Supervisor, require_script

    cfg = run_config(a)
    require_script(cfg.command, cfg.module, "run")  # after the config's own checks
    return Supervisor(cfg).run()


def _preflight(a: argparse.Namespace) -> int:
    from unbroken.elastic import preflight

    cfg = preflight_config(a)
    if not (cfg.ckpt_dir or cfg.data or cfg.rdzv_endpoint or cfg.gpus is not None):
        # every check would be skipped, and "all ok" would be a check that never ran
        raise ValueError(
            "nothing to check: pass --ckpt-dir, --data, --rdzv-endpoint and/or --nproc-per-node"
        )
    results = preflight.run_preflight(cfg)
    print(preflight.format_results(results))
    return 0 if all(r.ok for r in results) else 1


def _add_run(sub: Sub) -> None:
    p = add_command(
        sub,
        "run",
        "run a training script under torchrun: pre-flight, hang watchdog, fault "
        "classification, restarts",
        "unbroken run --nproc-per-node 8 --ckpt-dir /ckpt -- train.py --lr 3e-4",
        "Exit codes of run: 0 finished, 1 supervisor error, 2 usage, 3 same failure twice "
        "(see RUN_DIR/stop-report.txt), 4 restart budget used up, 5 no progress, 6 pre-flight "
        "never healthy, 7 preempted (SIGTERM/SIGINT; rerun to resume), 8 the checkpoint refused "
        "the job's configuration (RestoreRefused: world size, shapes; not retried).",
        func=_run,
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    add_config_flags(p, RUN_FLAGS)
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="module the standby agent imports before forking workers, on top of "
        "torch and unbroken.ckpt (repeatable; e.g. your model library)",
    )
    p.add_argument(
        "--fault-rule",
        action="append",
        default=[],
        metavar="CLASS=REGEX",
        help="extra classification rule, checked before the built-in table (repeatable)",
    )
    p.add_argument(
        "--torchrun-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument passed to torchrun as is (repeatable)",
    )


def _add_preflight(sub: Sub) -> None:
    p = add_command(
        sub,
        "preflight",
        "check storage, data, GPUs and rendezvous; exit 1 when a check fails",
        "unbroken preflight --ckpt-dir /ckpt --data /nvme/tok --nproc-per-node 8",
        func=_preflight,
    )
    add_config_flags(p, PREFLIGHT_FLAGS)


# --- report, plan ----------------------------------------------------------------------------


def _report(a: argparse.Namespace) -> int:
    import os

    from unbroken.common.events import load_events
    from unbroken.elastic import recovery

    events = load_events(a.run_dir)
    if not events:
        raise ValueError(f"{a.run_dir!r} has no events.jsonl; pass the --run-dir of `unbroken run`")
    print(recovery.format_summary(recovery.summarize(events)))
    if not a.no_plot:
        print(recovery.plot_timeline(events, a.out or os.path.join(a.run_dir, "timeline.png")))
    return 0


def _add_report(sub: Sub) -> None:
    p = add_command(
        sub,
        "report",
        "recovery phases per failure, goodput, slow-down trend and a PNG timeline of a run",
        "unbroken report unbroken-run --out timeline.png",
        func=_report,
    )
    p.add_argument("run_dir", help="an `unbroken run` directory (holds events.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/timeline.png)")
    p.add_argument("--no-plot", action="store_true", help="table only")


def _plan(a: argparse.Namespace) -> int:
    from unbroken.elastic import planner

    given = {k: getattr(a, k) for k in ("ckpt_cost", "mtbf", "restart_cost", "current")}
    disk = planner.plan_from_run(a.run_dir, given)
    print(planner.format_plan(disk))
    mem_given = {k: getattr(a, k) for k in ("memory_cost", "step_time", "memory_fraction")}
    mem = planner.memory_plan_from_run(a.run_dir, mem_given, disk)
    if mem is not None:
        print(planner.format_memory_plan(mem))
    return 0


def _add_plan(sub: Sub) -> None:
    p = add_command(
        sub,
        "plan",
        "checkpoint interval (Young/Daly) and expected goodput, measured from a run or given",
        "unbroken plan --mtbf 86400 --ckpt-cost 30 --restart-cost 120",
        func=_plan,
    )
    p.add_argument("--run-dir", default=None, help="measure C, M, R and the current interval here")
    p.add_argument("--ckpt-cost", type=float, default=None, help="C: seconds one checkpoint costs")
    p.add_argument("--mtbf", type=float, default=None, help="M: mean time between failures, s")
    p.add_argument("--restart-cost", type=float, default=None, help="R: seconds per recovery")
    p.add_argument("--current", type=float, default=None, help="current interval, seconds")
    p.add_argument(
        "--memory-cost", type=float, default=None,
        help="c_m: seconds one memory-tier publish costs the loop (suggests K and N)",
    )  # fmt: skip
    p.add_argument("--step-time", type=float, default=None, help="seconds per training step")
    p.add_argument(
        "--memory-fraction", type=float, default=None,
        help="share of failures the memory tier covers (they keep their node), 0..1",
    )  # fmt: skip


# --- drill ----------------------------------------------------------------------------------


def _drill(a: argparse.Namespace) -> int:
    import os

    from unbroken.common.text import printable
    from unbroken.elastic.drill import runner as drill
    from unbroken.elastic.supervisor import require_script

    for flag, ref, sub in (
        ("--reference", a.reference, "reference-w1"),
        ("--reference-w2", a.reference_w2, "reference-w2"),
    ):
        if ref is not None and not os.path.isdir(ref):  # else read as a run that logged nothing
            raise ValueError(
                f"{flag} {printable(ref)}: no such directory; pass the {sub} directory of an "
                f"earlier drill of the same command (DRILL_DIR/{sub})"
            )
    command = _command(a)
    faults = tuple(f.strip() for f in a.faults.split(",") if f.strip()) if a.faults else None
    opts = dict(
        faults=faults,
        outage=a.outage,
        timeout=a.timeout,
        reference=a.reference,
        reference_w2=a.reference_w2,
        supervisor_args=tuple(a.supervisor_arg),
        may_differ=tuple(_may_differ(x) for x in a.may_differ),
        ckpt_subdir=a.ckpt_subdir,
        metrics_file=a.metrics_file,
    )
    if a.hang_timeout is not None:
        opts["hang_timeout"] = a.hang_timeout
    if a.steps is not None and not a.example:
        raise ValueError("--steps is for --example; your script takes its own step count in ARGS")
    if a.example:
        cfg = drill.example_config(a.dir, steps=a.steps or 50, seed=a.seed, extra=command, **opts)
    else:
        cfg = drill.DrillConfig(
            command,
            a.dir,
            module=a.module,
            seed=a.seed,
            multi_rank=a.multi_rank,
            ckpt_every=a.ckpt_every,
            **opts,
        )
        require_script(command, a.module, "drill")  # after the config's own checks
    report = drill.run_drill(cfg)
    print(report.format_table())
    print("report: " + ", ".join(report.files.values()))
    return 0 if report.passed else 1


def _may_differ(spec: str) -> tuple[str, str]:
    key, sep, why = spec.partition("=")
    if not sep:
        raise ValueError(
            f"--may-differ {spec!r}: expected KEY=WHY, e.g. "
            "--may-differ 'values/best_val_loss=eval batches drawn per rank'"
        )
    return key.strip(), why.strip()


def _add_drill(sub: Sub) -> None:
    p = add_command(
        sub,
        "drill",
        "kill the job on purpose and prove the resumed run is identical (exit 1 when it is not)",
        "unbroken drill --dir drill -- train.py --out {dir} --steps 200",
        "Faults: SIGKILL, kill during save, hang, corrupt checkpoint, storage outage, lost "
        "agent, world-size change; with a memory tier (by name) SIGKILL restored from memory, "
        "damaged memory slot, node loss restored from the peer replica. Runs the command once without faults (the reference), "
        "then under `unbroken run` with a seeded schedule of injected faults, and compares "
        "final state, loss curve, data order and recovery phases; each fault's row says which "
        "steps it compared. {dir} in ARGS is replaced by each run's directory; the script "
        "checkpoints with unbroken's Checkpointer into {dir}/ckpt (restore() at start, a final "
        "checkpoint at the last step) and logs the loss (and, to compare the data order, the "
        "sample ids: loader.forever().take_ids(), or StreamingDataset(with_ids=True) with "
        "global_ids) per step to {dir}/metrics.jsonl. Writes "
        "drill.txt, drill.json and timeline.png into --dir. Try it: unbroken drill --example.",
        func=_drill,
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="-- SCRIPT ARGS with {dir} (with --example: extra demo arguments, "
        "e.g. -- --break rng)",
    )
    _add_drill_plan(p)
    _add_drill_runs(p)


def _add_drill_plan(p: argparse.ArgumentParser) -> None:
    """What the drill runs and which faults it injects where."""
    p.add_argument("--example", action="store_true", help="drill the demo model (tiny GPT)")
    p.add_argument(
        "--dir",
        default="unbroken-drill",
        help="drill directory: runs, logs and the report (default: ./unbroken-drill)",
    )
    p.add_argument(
        "--faults",
        default=None,
        metavar="K,K",
        help="kill, kill-in-save, hang, corrupt, storage, agent-loss, world-size "
        "(default: all that apply); by name only, for a script with a memory tier: "
        "kill-memory, memory-damage, node-loss (2 nodes, --multi-rank: a node lost whole, "
        "a replacement restores from the peer replica)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the fault schedule; the same seed replays the same drill",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="--example only: demo steps (default 50)"
    )
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument(
        "--multi-rank",
        action="store_true",
        help="the script trains on 2 ranks and resumes on another world size "
        "(enables agent-loss, world-size and node-loss; implied by --example)",
    )


def _add_drill_runs(p: argparse.ArgumentParser) -> None:
    """Where the drilled script keeps its state, and the limits of each run."""
    p.add_argument(
        "--ckpt-subdir", default="ckpt", help="Checkpointer root under {dir} (default: ckpt)"
    )
    p.add_argument(
        "--metrics-file",
        default="metrics.jsonl",
        help="MetricLog file under {dir} (default: metrics.jsonl)",
    )
    p.add_argument(
        "--ckpt-every",
        type=at_least(1),
        default=None,
        help="steps between checkpoints (default: inferred from the reference)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        help="supervisor hang timeout in seconds (default: 60; --example: 4)",
    )
    p.add_argument(
        "--outage",
        type=float,
        default=2.0,
        help="seconds the checkpoint directory stays unreachable, at least (default 2)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="give up a run after this many seconds (default 900)",
    )
    p.add_argument(
        "--reference",
        default=None,
        metavar="DIR",
        help="reuse a finished 1-rank reference run of the same command",
    )
    p.add_argument(
        "--reference-w2",
        default=None,
        metavar="DIR",
        help="reuse a finished 2-rank reference run of the same command (e.g. "
        "DRILL/reference-w2 of an earlier drill)",
    )
    p.add_argument(
        "--may-differ",
        action="append",
        default=[],
        metavar="KEY=WHY",
        help="a final-state key that may differ after a world-size change, and why "
        "(printed in the report; repeatable), e.g. 'values/best_val_loss=eval on per-rank RNG'",
    )
    p.add_argument(
        "--supervisor-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `unbroken run` argument for the drilled runs (repeatable)",
    )


def add_elastic(sub: Sub) -> None:
    """``run``, ``preflight``, ``report``, ``plan``, ``drill``: top-level commands."""
    for add in (_add_run, _add_preflight, _add_report, _add_plan, _add_drill):
        add(sub)
