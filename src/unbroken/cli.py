"""`unbroken <verb>`: parses arguments, calls the library, prints. No logic lives here.

Each command group has one ``_add_<group>`` function that registers its sub-parsers and
sets ``func`` to a small handler; handlers import the library lazily so ``unbroken --help``
stays fast.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from unbroken._cli_dataprep import add_dataprep

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


# --- lifeline 2: checkpoints -------------------------------------------------------------


def _add_ckpt(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="inspect, verify and export checkpoints")
    cs = p.add_subparsers(dest="ckpt_cmd", required=True)
    ls = cs.add_parser("ls", help="table of checkpoints: step, size, age, status")
    ls.add_argument("dir", help="checkpoint root (local path or fsspec URL)")
    ls.add_argument("--archive", default=None, help="remote archive URL to list as well")
    ls.set_defaults(func=_ckpt_ls)
    ins = cs.add_parser("inspect", help="print a checkpoint's manifest in human form")
    ins.add_argument("dir")
    ins.add_argument("--step", type=int, default=None, help="default: newest committed")
    ins.set_defaults(func=_ckpt_inspect)
    ver = cs.add_parser("verify", help="restore()'s full verification, read-only; exit 1 on damage")
    ver.add_argument("dir")
    ver.add_argument("--step", type=int, default=None, help="default: every step-N directory")
    ver.set_defaults(func=_ckpt_verify)
    exp = cs.add_parser(
        "export",
        help="write one component's consolidated weights to a .safetensors file",
        description="Verify a checkpoint and write the tensors of one component (default: "
        "model) to a safetensors file, keyed by the component's own state_dict names "
        "(e.g. 0.weight). Needs safetensors: pip install 'unbroken[export]'.",
    )
    exp.add_argument("dir", help="checkpoint root")
    exp.add_argument("--to", required=True, metavar="FILE", help="output .safetensors path")
    exp.add_argument("--step", type=int, default=None, help="default: newest committed")
    exp.add_argument("--component", default="model",
                     help="TrainState component to export: model (default), ema, or model.NAME")
    exp.set_defaults(func=_ckpt_export)


def _ckpt_ls(a: argparse.Namespace) -> int:
    from unbroken.ckpt import export as cli_support

    print(cli_support.format_listing(a.dir, archive=a.archive))
    return 0


def _ckpt_inspect(a: argparse.Namespace) -> int:
    from unbroken.ckpt import export as cli_support

    print(cli_support.format_manifest(a.dir, a.step))
    return 0


def _ckpt_verify(a: argparse.Namespace) -> int:
    from unbroken.ckpt import export as cli_support

    ok, report = cli_support.verify_report(a.dir, a.step)
    print(report)
    return 0 if ok else 1


def _ckpt_export(a: argparse.Namespace) -> int:
    from unbroken.ckpt import export as cli_support

    print(cli_support.export_safetensors(a.dir, a.to, step=a.step, component=a.component))
    return 0


# --- the demo (the main job) ---------------------------------------------------------------


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a tiny GPT, SIGKILL it, resume, prove bit-identity")
    p.add_argument("--dir", default="demo-run", help="working directory (default: ./demo-run)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo)


def _demo(a: argparse.Namespace) -> int:
    from unbroken import demo

    return demo.run_demo(a.dir, steps=a.steps, seed=a.seed)


# --- lifeline 1: data (streaming order, input-pipeline diagnosis) --------------------------


def _add_data_inspect(ds: argparse._SubParsersAction) -> None:
    p = ds.add_parser(
        "inspect",
        help="per-epoch shuffle statistics of a dataset's streaming order",
        description="Print, per epoch, how well StreamingDataset shuffles DIR: mean absolute "
        "displacement (vs a random permutation), Spearman correlation of original index and "
        "position, share of consecutive samples from the same shard, correlation with the "
        "previous epoch, and the start of the shard order.",
    )
    p.add_argument("dir", help="local dataset directory (holds dataset.json)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default: 0)")
    p.add_argument("--epochs", type=int, default=3, help="epochs to inspect (default: 3)")
    p.add_argument(
        "--shuffle-window",
        type=int,
        default=None,
        help="samples per window (default: StreamingDataset's)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="token datasets: tokens/sequence")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.set_defaults(func=_data_inspect)


def _data_inspect(a: argparse.Namespace) -> int:
    import json

    from unbroken.data.diagnose.shuffle import format_shuffle_stats, shuffle_stats
    from unbroken.data.stream.dataset import StreamingDataset

    ds = StreamingDataset(
        a.dir, seed=a.seed, shuffle_window=a.shuffle_window, seq_len=a.seq_len, rank=0, world_size=1
    )
    stats = shuffle_stats(ds, a.epochs)
    if a.json:
        for s in stats:
            print(json.dumps(s.to_json()))
    else:
        print(format_shuffle_stats(ds, stats))
    return 0


def _add_data_bench(ds: argparse._SubParsersAction) -> None:
    p = ds.add_parser(
        "bench",
        help="time each input-pipeline stage alone and name the one that limits",
        description="Run each stage alone on DIR - (network,) shard read, decode/transform, "
        "collate, worker transport, pin, H2D - print each one's samples/s next to the "
        "consumer's rate, name the stage that limits, and suggest num_workers and "
        "prefetch_factor (and, for a remote URL, the prefetch depth in shards).",
    )
    p.add_argument("dir", help="dataset directory or fsspec URL (holds dataset.json)")
    p.add_argument("--cache-dir", default=None,
                   help="remote URL: where the scratch cache goes (default: the temp dir)")
    p.add_argument("--storage-options", default=None, metavar="JSON",
                   help='remote URL: fsspec options, e.g. \'{"endpoint_url": "http://..."}\'')
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch (default: 32)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers to evaluate (default: cores - 1)")
    p.add_argument("--consume-rate", type=float, default=None,
                   help="samples/s the model consumes (or use --timeline)")
    p.add_argument("--timeline", default=None,
                   help="RUN_DIR or data_steps.csv of a run: consumer rate from its compute time")
    p.add_argument("--transform", default="basic",
                   help="per-sample decode: 'basic' (by extension, default), 'none', "
                   "'package.module:function' or 'path/to/train.py:function' (a function "
                   "defined in your training script; its __main__ block does not run)")
    p.add_argument("--seq-len", type=int, default=None, help="token datasets: tokens/sequence")
    p.add_argument("--device", default=None,
                   help="device for the pin and H2D stages (default: cuda when available)")
    p.add_argument("--batches", type=int, default=50, help="batches to time (default: 50)")
    p.add_argument("--max-seconds", type=float, default=20.0,
                   help="time budget of the whole bench (default: 20)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed of the order read")
    p.add_argument("--out", default=None,
                   help="RUN_DIR to write data_bench.json into (for `unbroken data report`)")
    p.add_argument("--metrics", default=None, help="metric log (.jsonl) to append the rates to")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_data_bench)


def _data_bench(a: argparse.Namespace) -> int:
    import json

    from unbroken.data.diagnose.bench import run_bench

    try:
        opts = None if a.storage_options is None else json.loads(a.storage_options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--storage-options {a.storage_options!r} is not JSON ({e})") from None
    report, path = run_bench(
        a.dir, batch_size=a.batch_size, num_workers=a.num_workers,
        consume_rate=a.consume_rate, timeline=a.timeline, transform=a.transform,
        seq_len=a.seq_len, device=a.device, num_batches=a.batches,
        max_seconds=a.max_seconds, seed=a.seed, out=a.out, metrics=a.metrics,
        cache_dir=a.cache_dir, storage_options=opts,
    )
    print(json.dumps(report.to_json()) if a.json else report.format())
    if path is not None:
        print(f"wrote {path}")
    return 0


def _add_data_report(ds: argparse._SubParsersAction) -> None:
    p = ds.add_parser(
        "report",
        help="stall summary, sawtooth check and a PNG of a run's step timeline and stages",
        description="Read RUN_DIR/data_steps.csv (StepTimer) and/or RUN_DIR/data_bench.json "
        "(data bench --out), print the stall summary, the sawtooth verdict and the stage "
        "table, and write a PNG (needs matplotlib: pip install 'unbroken[plot]').",
    )
    p.add_argument("run_dir", help="directory holding data_steps.csv and/or data_bench.json")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/data_report.png)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="workers of the run, to relate a sawtooth period to (default: from "
                   "the timeline header)")
    p.add_argument("--no-plot", action="store_true", help="text only")
    p.set_defaults(func=_data_report)


def _data_report(a: argparse.Namespace) -> int:
    from unbroken.data.diagnose.plot import run_report

    text, png = run_report(a.run_dir, out=a.out, num_workers=a.num_workers, plot=not a.no_plot)
    print(text)
    if png is not None:
        print(f"wrote {png}")
    return 0


# `unbroken data <cmd>`: each entry registers one sub-command; append yours here.
_DATA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_data_inspect, _add_data_bench, _add_data_report,
]


def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="inspect the streaming order; diagnose the input pipeline")
    ds = p.add_subparsers(dest="data_cmd", required=True)
    for add in _DATA_COMMANDS:
        add(ds)


# --- lifeline 2b: the elastic supervisor ----------------------------------------------------


def _add_elastic(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script under torchrun with pre-flight, hang watchdog, "
        "fault classification and restarts",
        description="Exit codes: 0 finished, 1 supervisor error, 2 usage, 3 same failure "
        "twice (see RUN_DIR/stop-report.txt), 4 restart budget used up, 5 no progress, "
        "6 pre-flight never healthy, 7 preempted (SIGTERM/SIGINT; rerun to resume).",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    p.add_argument("--run-dir", default="unbroken-run",
                   help="events.jsonl, recovery.jsonl, logs, beats, stack dumps (default: ./unbroken-run)")
    p.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (default: 1)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default: 1)")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("--rdzv-endpoint", default="127.0.0.1:0",
                   help="HOST:PORT of the rendezvous store, hosted by the supervisor on HOST "
                   "(default: 127.0.0.1 on a free port; multi-node needs a fixed port)")
    p.add_argument("--run-id", default="unbroken", help="job name shared by all nodes")
    p.add_argument("--node", default="", help="this node's name (default: HOSTNAME-PID)")
    p.add_argument("--max-restarts", type=int, default=10, help="restart budget (default: 10)")
    p.add_argument("--backoff", type=float, default=1.0,
                   help="seconds before the first restart, doubled per restart without progress")
    p.add_argument("--backoff-max", type=float, default=60.0, help="backoff cap (default: 60 s)")
    p.add_argument("--no-progress-limit", type=int, default=3,
                   help="stop after N restarts in a row without a newer checkpoint (default: 3)")
    p.add_argument("--hang-timeout", type=float, default=300.0,
                   help="seconds without a beat before the workers count as hung (default: 300)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds from heartbeat.install() to the first beat (default: 900)")
    p.add_argument("--poll-interval", type=float, default=0.5, help="watchdog period (default: 0.5 s)")
    p.add_argument("--dump-grace", type=float, default=3.0,
                   help="seconds hung workers get to write stack dumps (default: 3)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint root to probe in pre-flight")
    p.add_argument("--data", default=None, help="dataset dir or dataset.json to validate in pre-flight")
    p.add_argument("--min-free-bytes", type=int, default=256 << 20,
                   help="free space needed before the first checkpoint (default: 256 MiB)")
    p.add_argument("--preflight-timeout", type=float, default=30.0,
                   help="seconds per pre-flight probe before it counts as hung (default: 30)")
    p.add_argument("--preflight-max-wait", type=float, default=3600.0,
                   help="wait this long for a healthy pre-flight, then exit 6 (default: 3600 s)")
    p.add_argument("--last-call-timeout", type=float, default=5.0,
                   help="after MIN nodes joined, wait this long for more (default: 5 s)")
    p.add_argument("--join-timeout", type=float, default=600.0,
                   help="rendezvous must reach MIN nodes within this (default: 600 s)")
    p.add_argument("--node-timeout", type=float, default=5.0,
                   help="a peer supervisor silent this long counts as a lost node (default: 5 s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds the job gets to save before it is killed (default: 30)")
    p.add_argument("--stop-grace", type=float, default=1.0,
                   help="when a rank fails, seconds the other ranks get to exit before they "
                   "are killed: they cannot finish a collective with it (default: 1)")
    p.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="start a fresh torchrun and fresh worker interpreters per attempt "
                   "instead of a standby agent that imported torch ahead and forks the workers")
    p.add_argument("--preload", action="append", default=[], metavar="MODULE",
                   help="module the standby agent imports before forking workers, on top of "
                   "torch and unbroken.ckpt (repeatable; e.g. your model library)")
    p.add_argument("--fault-rule", action="append", default=[], metavar="CLASS=REGEX",
                   help="extra classification rule, checked before the built-in table (repeatable)")
    p.add_argument("--torchrun-arg", action="append", default=[], metavar="ARG",
                   help="extra argument passed to torchrun as is (repeatable)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not echo the job's output")
    p.set_defaults(func=_elastic_run)

    pf = sub.add_parser("preflight", help="check storage, data, GPUs and rendezvous; exit 1 on failure")
    pf.add_argument("--ckpt-dir", default=None, help="checkpoint root: reachable, writable, free space")
    pf.add_argument("--data", default=None, help="dataset dir or dataset.json: present and valid")
    pf.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT that must accept connections")
    pf.add_argument("--nproc-per-node", type=int, default=None, help="GPUs needed when CUDA is present")
    pf.add_argument("--min-free-bytes", type=int, default=256 << 20)
    pf.add_argument("--gpu-min-free", type=float, default=0.9,
                    help="fraction of each GPU's memory that must be free (default: 0.9)")
    pf.add_argument("--timeout", type=float, default=30.0, help="seconds per probe (default: 30)")
    pf.set_defaults(func=_elastic_preflight)


def _elastic_run(a: argparse.Namespace) -> int:
    from unbroken.elastic import faults
    from unbroken.elastic._attempt import DEFAULT_PRELOAD
    from unbroken.elastic.preflight import PreflightConfig
    from unbroken.elastic.supervisor import RendezvousConfig, RunConfig, Supervisor, WatchdogConfig

    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    cfg = RunConfig(
        command=tuple(command),
        run_dir=a.run_dir,
        nproc_per_node=a.nproc_per_node,
        module=a.module,
        rdzv=RendezvousConfig(a.nnodes, a.rdzv_endpoint, a.run_id, a.node, a.last_call_timeout,
                              a.join_timeout, a.node_timeout),
        watchdog=WatchdogConfig(a.hang_timeout, a.startup_timeout, a.poll_interval, a.dump_grace),
        policy=faults.RestartPolicy(a.max_restarts, a.backoff, a.backoff_max,
                                    no_progress_limit=a.no_progress_limit),
        preflight=PreflightConfig(a.ckpt_dir, a.data, a.min_free_bytes, timeout=a.preflight_timeout),
        preflight_max_wait=a.preflight_max_wait,
        shutdown_timeout=a.shutdown_timeout,
        stop_grace=a.stop_grace,
        prewarm=a.prewarm,
        preload=(*DEFAULT_PRELOAD, *a.preload),
        rules=(*(faults.parse_rule(r) for r in a.fault_rule), *faults.DEFAULT_RULES),
        torchrun_args=tuple(a.torchrun_arg),
        echo=not a.quiet,
    )
    _check_script(command, a.module, "run")  # after the config's own checks
    return Supervisor(cfg).run()


def _elastic_preflight(a: argparse.Namespace) -> int:
    from unbroken.elastic import preflight

    cfg = preflight.PreflightConfig(a.ckpt_dir, a.data, a.min_free_bytes, a.rdzv_endpoint,
                                    a.nproc_per_node, a.gpu_min_free, a.timeout)
    results = preflight.run_preflight(cfg)
    print(preflight.format_results(results))
    return 0 if all(r.ok for r in results) else 1


def _add_recovery(sub: argparse._SubParsersAction) -> None:
    rp = sub.add_parser("report", help="recovery phases per failure, goodput, trend, PNG timeline")
    rp.add_argument("run_dir", help="an `unbroken run` directory (holds events.jsonl)")
    rp.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/timeline.png)")
    rp.add_argument("--no-plot", action="store_true", help="table only")
    rp.set_defaults(func=_report)
    pl = sub.add_parser("plan", help="checkpoint interval (Young/Daly) and expected goodput")
    pl.add_argument("--run-dir", default=None, help="measure C, M, R and the current interval here")
    pl.add_argument("--ckpt-cost", type=float, default=None, help="C: seconds one checkpoint costs")
    pl.add_argument("--mtbf", type=float, default=None, help="M: mean time between failures, s")
    pl.add_argument("--restart-cost", type=float, default=None, help="R: seconds per recovery")
    pl.add_argument("--current", type=float, default=None, help="current interval, seconds")
    pl.set_defaults(func=_plan)


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


def _plan(a: argparse.Namespace) -> int:
    from unbroken.elastic import planner

    given = {k: getattr(a, k) for k in ("ckpt_cost", "mtbf", "restart_cost", "current")}
    print(planner.format_plan(planner.plan_from_run(a.run_dir, given)))
    return 0


def _check_script(command: Sequence[str], module: bool, verb: str) -> None:
    """A missing training script is bad input, found before any process starts (torchrun
    would start, fail, and the restart policy would try again)."""
    if command and not module and not os.path.isfile(command[0]):
        raise FileNotFoundError(
            f"{command[0]}: training script not found; use `unbroken {verb} [options] -- "
            "SCRIPT ARGS` with the path of a Python script, or -m for a module name"
        )


# --- the fire drill -------------------------------------------------------------------------


def _add_drill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drill",
        help="kill the job on purpose (SIGKILL, kill during save, hang, corrupt checkpoint, "
        "storage outage, lost agent, world-size change) and prove the resumed run is identical",
        description="Runs the command once without faults (the reference), then under "
        "`unbroken run` with a seeded schedule of injected faults, and compares final state, "
        "loss curve, data order and recovery phases; each fault's row says which steps it "
        "compared. {dir} in ARGS is replaced by each run's directory; the script checkpoints "
        "with unbroken's Checkpointer into {dir}/ckpt (restore() at start, a final checkpoint "
        "at the last step) and logs the loss (and, to compare the data order, the sample ids: "
        "StreamingDataset(with_ids=True)) per step to {dir}/metrics.jsonl. Writes drill.txt, "
        "drill.json and timeline.png into --dir. Exit codes: 0 pass, 1 fail, 2 usage.",
    )
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- SCRIPT ARGS with {dir} (with --example: extra demo arguments, "
                   "e.g. -- --break rng)")
    p.add_argument("--example", action="store_true", help="drill the demo model (tiny GPT)")
    p.add_argument("--dir", default="unbroken-drill",
                   help="drill directory: runs, logs and the report (default: ./unbroken-drill)")
    p.add_argument("--faults", default=None, metavar="K,K",
                   help="kill, kill-in-save, hang, corrupt, storage, agent-loss, world-size "
                   "(default: all that apply)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the fault schedule; the same seed replays the same drill")
    p.add_argument("--steps", type=int, default=None, help="--example only: demo steps (default 50)")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("--multi-rank", action="store_true",
                   help="the script trains on 2 ranks and resumes on another world size "
                   "(enables agent-loss and world-size; implied by --example)")
    p.add_argument("--ckpt-subdir", default="ckpt", help="Checkpointer root under {dir}")
    p.add_argument("--metrics-file", default="metrics.jsonl", help="MetricLog file under {dir}")
    p.add_argument("--ckpt-every", type=int, default=None,
                   help="steps between checkpoints (default: inferred from the reference)")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="supervisor hang timeout in seconds (default: 60; --example: 4)")
    p.add_argument("--outage", type=float, default=2.0,
                   help="seconds the checkpoint directory stays unreachable, at least (default 2)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="give up a run after this many seconds (default 900)")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="reuse a finished 1-rank reference run of the same command")
    p.add_argument("--supervisor-arg", action="append", default=[], metavar="ARG",
                   help="extra `unbroken run` argument for the drilled runs (repeatable)")
    p.set_defaults(func=_drill)


def _drill(a: argparse.Namespace) -> int:
    from unbroken.elastic.drill import runner as drill

    command = tuple(a.command[1:] if a.command[:1] == ["--"] else a.command)
    faults = tuple(f.strip() for f in a.faults.split(",") if f.strip()) if a.faults else None
    opts = dict(faults=faults, outage=a.outage, timeout=a.timeout, reference=a.reference,
                supervisor_args=tuple(a.supervisor_arg), ckpt_subdir=a.ckpt_subdir,
                metrics_file=a.metrics_file)
    if a.hang_timeout is not None:
        opts["hang_timeout"] = a.hang_timeout
    if a.steps is not None and not a.example:
        raise ValueError("--steps is for --example; your script takes its own step count in ARGS")
    if a.example:
        cfg = drill.example_config(a.dir, steps=a.steps or 50, seed=a.seed, extra=command, **opts)
    else:
        cfg = drill.DrillConfig(command, a.dir, module=a.module, seed=a.seed,
                                multi_rank=a.multi_rank, ckpt_every=a.ckpt_every, **opts)
    if not a.example:
        _check_script(command, a.module, "drill")  # after the config's own checks
    report = drill.run_drill(cfg)
    print(report.format_table())
    print("report: " + ", ".join(report.files.values()))
    return 0 if report.passed else 1


# -------------------------------------------------------------------------------------------

_GROUPS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_demo, _add_ckpt, _add_data, _add_elastic, _add_recovery, add_dataprep, _add_drill,
]


_PRINTS_SUMMARY = frozenset({"pack", "index", "tokenize", "stage"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unbroken", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for add in _GROUPS:
        add(sub)
    return parser


# Exit codes of main() for errors: 2 = bad input (a path, a value, a damaged or foreign file:
# the user can fix it), 1 = the command failed for another reason (an internal error, an
# I/O failure such as a full disk). Either way one line on stderr, never a traceback (with
# --verbose the traceback of an unexpected error is printed too).
_BAD_PATH_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES, errno.EPERM,
     errno.ELOOP, errno.ENAMETOOLONG, errno.EINVAL, errno.EROFS}
)


def _one_line(e: BaseException) -> str:
    """The exception's message on one line (a multi-line message is joined with ' | ')."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = " | ".join(lines) or type(e).__name__
    return text if len(text) <= 4000 else text[:4000] + " ..."


def _exit_code(e: BaseException) -> int:
    if isinstance(e, (ValueError, RuntimeError)):
        return 2
    if isinstance(e, OSError):
        return 2 if e.errno in _BAD_PATH_ERRNOS or e.errno is None else 1
    return 1


def _nonsense(args: argparse.Namespace) -> str | None:
    """A value no command takes, whatever its option: a float that is not finite (argparse's
    ``float`` accepts "nan" and "1e400"), a string with a NUL byte (no path holds one)."""
    for name, v in vars(args).items():
        if isinstance(v, float) and not math.isfinite(v):
            return f"--{name.replace('_', '-')}={v}: not a finite number"
        vals = v if isinstance(v, list) else [v]
        if any(isinstance(x, str) and "\x00" in x for x in vals):
            return f"{name}: a value holds a NUL byte"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = _nonsense(args)
    if bad is not None:
        print(f"unbroken: error: {bad}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.cmd in _PRINTS_SUMMARY and not args.verbose:
        # These commands print their summary on stdout; the library's INFO line says the same.
        logging.getLogger("unbroken.data").setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("unbroken: interrupted", file=sys.stderr)
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except (ValueError, RuntimeError, OSError) as e:
        print(f"unbroken: error: {_one_line(e)}", file=sys.stderr)
        return _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - DCP raises BaseException subclasses
        # Not an error the library names: say what it was in one line; the traceback is for
        # --verbose (and for a bug report).
        if args.verbose:
            traceback.print_exc()
        print(
            f"unbroken: error: {type(e).__name__}: {_one_line(e)} (unexpected; run with "
            "--verbose for the traceback and report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
