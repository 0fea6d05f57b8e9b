"""`unbroken <verb>`: parses arguments, calls the library, prints. No logic lives here.

Each command group has one ``_add_<group>`` function that registers its sub-parsers and
sets ``func`` to a small handler; handlers import the library lazily so ``unbroken --help``
stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

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
    ver = cs.add_parser("verify", help="verify checksums; exit 1 on damage")
    ver.add_argument("dir")
    ver.add_argument("--step", type=int, default=None, help="default: every committed step")
    ver.set_defaults(func=_ckpt_verify)


def _ckpt_ls(a: argparse.Namespace) -> int:
    from unbroken.ckpt import cli_support

    print(cli_support.format_listing(a.dir, archive=a.archive))
    return 0


def _ckpt_inspect(a: argparse.Namespace) -> int:
    from unbroken.ckpt import cli_support

    print(cli_support.format_manifest(a.dir, a.step))
    return 0


def _ckpt_verify(a: argparse.Namespace) -> int:
    from unbroken.ckpt import cli_support

    ok, report = cli_support.verify_report(a.dir, a.step)
    print(report)
    return 0 if ok else 1


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
        "--shuffle-window", type=int, default=None, help="samples per window (default: 4 shards)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="token datasets: tokens/sequence")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.set_defaults(func=_data_inspect)


def _data_inspect(a: argparse.Namespace) -> int:
    import json

    from unbroken.data.dataset import StreamingDataset
    from unbroken.data.quality import format_shuffle_stats, shuffle_stats

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
        description="Run each stage alone on DIR - shard read, decode/transform, collate, "
        "worker transport, pin, H2D - print each one's samples/s next to the consumer's "
        "rate, name the stage that limits, and suggest num_workers and prefetch_factor.",
    )
    p.add_argument("dir", help="local dataset directory (holds dataset.json)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch (default: 32)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers to evaluate (default: cores - 1)")
    p.add_argument("--consume-rate", type=float, default=None,
                   help="samples/s the model consumes (or use --timeline)")
    p.add_argument("--timeline", default=None,
                   help="RUN_DIR or data_steps.csv of a run: consumer rate from its compute time")
    p.add_argument("--transform", default="basic",
                   help="per-sample decode: 'basic' (by extension, default), 'none', or "
                   "'package.module:function'")
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

    from unbroken.data.bottleneck import run_bench

    report, path = run_bench(
        a.dir, batch_size=a.batch_size, num_workers=a.num_workers,
        consume_rate=a.consume_rate, timeline=a.timeline, transform=a.transform,
        seq_len=a.seq_len, device=a.device, num_batches=a.batches,
        max_seconds=a.max_seconds, seed=a.seed, out=a.out, metrics=a.metrics,
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
    from unbroken.data.report_plot import run_report

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


# -------------------------------------------------------------------------------------------

_GROUPS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo, _add_ckpt, _add_data]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unbroken", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for add in _GROUPS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError, FileNotFoundError, PermissionError) as e:
        print(f"unbroken: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
