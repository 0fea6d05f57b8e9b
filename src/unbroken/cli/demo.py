"""``unbroken demo``: the tiny-GPT proof that a SIGKILLed run resumes bit-identically."""

from __future__ import annotations

import argparse

from unbroken.cli._args import Sub, add_command

__all__ = ["add_demo"]


# what an earlier demo leaves in its directory (run_demo empties it first)
_DEMO_RUNS = frozenset({"reference", "killed"})
_DEMO_ENTRIES = _DEMO_RUNS | {"data"}


def _demo(a: argparse.Namespace) -> int:
    import os

    from unbroken import demo
    from unbroken.common.text import printable

    # the demo removes its directory first: never one that holds anything else (`--dir .`)
    if os.path.isdir(a.dir):
        entries = set(os.listdir(a.dir))
        # a demo's directory holds its runs (a lone `data/` may be the user's own)
        mine = entries <= _DEMO_ENTRIES and (not entries or bool(entries & _DEMO_RUNS))
        foreign = [] if mine else sorted(entries - _DEMO_RUNS)
        if foreign:
            shown = ", ".join(printable(n) for n in foreign[:3]) + (" ..." if foreign[3:] else "")
            raise ValueError(
                f"--dir {printable(a.dir)} holds files the demo did not write ({shown}), and "
                "the demo empties its directory first; pass a new directory (or an earlier "
                "demo's)"
            )
    elif os.path.exists(a.dir):
        raise ValueError(f"--dir {printable(a.dir)} is not a directory; pass a new directory")
    return demo.run_demo(a.dir, steps=a.steps, seed=a.seed)


def add_demo(sub: Sub) -> None:
    p = add_command(
        sub,
        "demo",
        "train a tiny GPT, SIGKILL it, resume, prove bit-identity (exit 1 if not)",
        "unbroken demo --dir demo-run --steps 200",
        "Packs a small corpus into tar shards, trains without faults (the reference), trains "
        "again and SIGKILLs the run at a random step, resumes it, and compares model, "
        "optimizer, scheduler, EMA, loss curve and data order.",
        func=_demo,
    )
    p.add_argument(
        "--dir", default="demo-run", help="working directory, emptied first (default: ./demo-run)"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, data and kill step")
