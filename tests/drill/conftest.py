"""Fixtures for the drill tests: a drill token per test whose processes are all killed at
teardown (pass or fail), and one reference run of the demo shared by the module."""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from unbroken.cli import main
from unbroken.common.procs import kill_matching
from unbroken.elastic.drill.runner import ENV_TOKEN, example_config, run_reference

STEPS = 50
"""Demo steps in every drill test (the reference is shared, so they must agree)."""


@pytest.fixture(scope="session")
def drill_steps() -> int:
    return STEPS


@pytest.fixture
def token() -> Iterator[str]:
    """Pass to ``run_drill(..., token=token)``: whatever carries it dies at teardown."""
    t = uuid.uuid4().hex
    yield t
    kill_matching(ENV_TOKEN, t, timeout=10.0)


@pytest.fixture(scope="module")
def demo_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A finished 1-rank reference run of the demo drill command (``{dir}``)."""
    t = uuid.uuid4().hex
    d = os.path.join(str(tmp_path_factory.mktemp("drill-ref")), "reference-w1")
    try:
        run_reference(example_config("unused", steps=STEPS), d, 1, token=t)
        yield d
    finally:
        kill_matching(ENV_TOKEN, t, timeout=10.0)


WorldSizeDrill = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="session")
def world_size_drill(tmp_path_factory: pytest.TempPathFactory) -> WorldSizeDrill:
    """``world_size_drill(name, command, *options)`` runs ``unbroken drill --multi-rank
    --faults world-size --dir D *options -- *command`` in this process: (exit code, its
    console, D). ``D/reference-w2`` is then the command run uninterrupted on 2 ranks under
    plain ``torchrun --standalone`` (with ``{dir}`` = that directory): a module's SIGKILL test
    can take it as its reference instead of running the same command again."""

    def run(name: str, command: list[str], *options: str) -> tuple[int, str, str]:
        out = str(tmp_path_factory.mktemp(name) / "drill")
        argv = ["drill", "--multi-rank", "--faults", "world-size", "--dir", out, *options]
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            rc = main([*argv, "--", *command])
        return rc, console.getvalue(), out

    return run
