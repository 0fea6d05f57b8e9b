"""``unbroken ckpt ls | inspect | verify | export``: look at checkpoints without a model."""

from __future__ import annotations

import argparse

from unbroken.cli._args import Sub, add_command, at_least

__all__ = ["add_ckpt"]


def _ls(a: argparse.Namespace) -> int:
    from unbroken.ckpt.export import format_listing

    print(format_listing(a.dir, archive=a.archive))
    return 0


def _inspect(a: argparse.Namespace) -> int:
    from unbroken.ckpt.export import format_manifest

    print(format_manifest(a.dir, a.step))
    return 0


def _verify(a: argparse.Namespace) -> int:
    from unbroken.ckpt.export import verify_report

    ok, report = verify_report(a.dir, a.step, progress=not a.no_progress, deep=a.deep)
    print(report)
    return 0 if ok else 1


def _export(a: argparse.Namespace) -> int:
    import os

    from unbroken.ckpt.export import export_safetensors
    from unbroken.common.text import printable

    # checked before the checkpoint is read and verified (minutes for a large one)
    if os.path.isdir(a.to):
        raise ValueError(
            f"--to {printable(a.to)} is a directory; pass a file path, e.g. "
            f"{printable(os.path.join(a.to, 'model.safetensors'))}"
        )
    if "://" not in a.dir:
        root, to = os.path.realpath(a.dir), os.path.realpath(a.to)
        if os.path.commonpath([root, to]) == root:
            # committed steps are immutable (and verify ignores files it did not write)
            raise ValueError(
                f"--to {printable(a.to)} is inside the checkpoint root {printable(a.dir)}; "
                "write the export outside it"
            )

    print(
        export_safetensors(
            a.dir, a.to, step=a.step, component=a.component, progress=not a.no_progress
        )
    )
    return 0


def _step(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--step", type=at_least(0), default=None, metavar="N", help=default)


def add_ckpt(sub: Sub) -> None:
    g = add_command(
        sub, "ckpt", "list, inspect, verify and export checkpoints", "unbroken ckpt verify /ckpt"
    )
    cs = g.add_subparsers(dest="ckpt_cmd", required=True, metavar="COMMAND")

    p = add_command(
        cs,
        "ls",
        "table of checkpoints: step, size, age, status",
        "unbroken ckpt ls /ckpt --archive s3://bucket/run1",
        func=_ls,
    )
    p.add_argument("dir", help="checkpoint root (local path or fsspec URL)")
    p.add_argument("--archive", default=None, help="remote archive URL to list as well")

    p = add_command(
        cs,
        "inspect",
        "print a checkpoint's manifest in human form",
        "unbroken ckpt inspect /ckpt --step 1200",
        func=_inspect,
    )
    p.add_argument("dir", help="checkpoint root")
    _step(p, "default: newest committed")

    p = add_command(
        cs,
        "verify",
        "restore()'s full verification, read-only; exit 1 on damage",
        "unbroken ckpt verify /ckpt",
        "Runs restore()'s own checks (manifest, paths, sizes, checksums, decoding) on every "
        "step-N directory, or on --step; nothing is moved or deleted.",
        func=_verify,
    )
    p.add_argument("dir", help="checkpoint root")
    _step(p, "default: every step-N directory")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also recompute every tensor's own checksum (manifest v4) or sum and norm (v1-3) "
        "and compare them with the manifest's (restore skips all but legacy statistics: "
        "they derive from the bytes the file checksums already cover)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = add_command(
        cs,
        "export",
        "write one component's consolidated weights to a .safetensors file",
        "unbroken ckpt export /ckpt --to model.safetensors --component ema",
        "Verify a checkpoint and write the tensors of one component (default: model) to a "
        "safetensors file, keyed by the component's own state_dict names (e.g. 0.weight), "
        "from any number of shards. Needs safetensors: pip install 'unbroken[export]'.",
        func=_export,
    )
    p.add_argument("dir", help="checkpoint root")
    p.add_argument("--to", required=True, metavar="FILE", help="output .safetensors path")
    _step(p, "default: newest committed")
    p.add_argument(
        "--component",
        default="model",
        help="TrainState component to export: model (default), ema, or model.NAME",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
