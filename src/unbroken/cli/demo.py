"""``unbroken demo``: the tiny-GPT proof that a SIGKILLed run resumes bit-identically."""

from __future__ import annotations

import argparse

from unbroken.cli._args import Sub, add_command

__all__ = ["add_demo"]


def _demo(a: argparse.Namespace) -> int:
    from unbroken import demo

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
