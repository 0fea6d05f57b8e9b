"""Test harness for `unbroken run`: start supervisors as real subprocesses, watch their run
directories, and kill *everything* they started when the test ends (pass or fail).

Every supervisor runs in its own session; torchrun and each worker run in sessions of their
own (torchrun uses ``start_new_session``), so one ``killpg`` is not enough. Every process
below a supervisor inherits ``UNBROKEN_RUN_DIR=<run dir>`` though, and that is what
:meth:`Job.kill_all` hunts for in /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

from unbroken.common import events
from unbroken.common.metrics import read_metrics
from unbroken.common.procs import (
    cmdline,
    environ_of,
    kill_matching,
    parent_of,
    pids_with_env,
    proc_state,
)
from unbroken.elastic import heartbeat

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_train.py")

# Tight settings so the suite stays short on 2 busy cores. The hang timeout is 3 s only in
# the hang test: on a loaded CI box an fsync alone can stall a healthy worker that long.
FAST = [
    "--poll-interval",
    "0.1",
    "--hang-timeout",
    "15",
    "--dump-grace",
    "1.5",
    "--backoff",
    "0.2",
    "--backoff-max",
    "1",
    "--preflight-timeout",
    "5",
    "--preflight-max-wait",
    "60",
    "--node-timeout",
    "2",
    "--last-call-timeout",
    "1",
    "--join-timeout",
    "60",
    "--shutdown-timeout",
    "5",
]


def script_args(tmp_path: Any, steps: int, **extra: object) -> list[str]:
    """elastic_train.py's arguments: checkpoints and metrics under ``tmp_path``."""
    args = [
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--metrics",
        str(tmp_path / "metrics.jsonl"),
        "--steps",
        str(steps),
    ]
    for k, v in extra.items():
        flag = f"--{k.replace('_', '-')}"
        args += [flag] if v is True else [flag, str(v)]
    return args


class Job:
    """One `unbroken run` supervisor process."""

    def __init__(
        self, run_dir: str, sup_args: list[str], script_args: list[str], script: str = SCRIPT
    ) -> None:
        self.run_dir = os.path.abspath(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.out_path = os.path.join(self.run_dir, "supervisor.out")
        self._out = open(self.out_path, "wb")
        argv = [
            sys.executable,
            "-m",
            "unbroken.cli",
            "run",
            "--run-dir",
            self.run_dir,
            *FAST,
            *sup_args,
            "--",
            script,
            *script_args,
        ]
        self.proc = subprocess.Popen(
            argv,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"supervisor did not exit within {timeout} s; output tail:\n{self.output()[-3000:]}"
            ) from None

    def output(self) -> str:
        with open(self.out_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        ev = events.load_events(self.run_dir)
        return ev if name is None else [e for e in ev if e["event"] == name]

    def beats(self, attempt: int) -> list[heartbeat.BeatRecord]:
        return heartbeat.read_beats(self.run_dir, attempt)

    def recoveries(self) -> list[dict[str, Any]]:
        with open(os.path.join(self.run_dir, "recovery.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]

    def kill_all(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_matching(events.ENV_RUN_DIR, self.run_dir, timeout=10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._out.close()


@contextlib.contextmanager
def jobs() -> Iterator[Callable[..., Job]]:
    """``with jobs() as start: job = start(run_dir, sup_args, script_args)``; kills all."""
    started: list[Job] = []

    def start(*args: Any, **kwargs: Any) -> Job:
        j = Job(*args, **kwargs)
        started.append(j)
        return j

    try:
        yield start
    finally:
        for j in started:
            j.kill_all()


def wait_until(pred: Callable[[], Any], timeout: float, what: str, job: Job | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if job is not None and job.proc.poll() is not None:
            raise AssertionError(
                f"supervisor exited ({job.proc.returncode}) while waiting for {what}:\n"
                f"{job.output()[-3000:]}"
            )
        time.sleep(0.05)
    tail = job.output()[-3000:] if job is not None else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tail}")


def live_beats(job: Job, attempt: int, min_step: int, ranks: int) -> list[heartbeat.BeatRecord]:
    """Beacons of ``ranks`` live workers of ``attempt`` once all reached ``min_step``."""
    bs = [b for b in job.beats(attempt) if b.started]
    by_rank = {b.rank: b for b in bs}
    if len(by_rank) >= ranks and all(b.step >= min_step for b in by_rank.values()):
        return sorted(by_rank.values(), key=lambda b: b.rank)
    return []


def pids_of(job: Job, attempt: int | None = None) -> list[int]:
    """Live processes (agents, standbys, workers) started under this job's run directory
    (of one attempt only, if given)."""
    pids = pids_with_env(events.ENV_RUN_DIR, job.run_dir)
    if attempt is None:
        return pids
    return [p for p in pids if environ_of(p).get(events.ENV_ATTEMPT) == str(attempt)]


def wait_gone(job: Job, timeout: float, what: str) -> None:
    """Until no process of ``job`` lives (its supervisor may be gone); the failure names
    what is left: pid, state, kernel wait channel, command line."""
    try:
        wait_until(lambda: not pids_of(job), timeout, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; left: {described(pids_of(job))}") from None


def described(pids: list[int]) -> list[str]:
    """``pid state wchan: command line`` of each live one, for a failure message."""
    out = []
    for p in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/wchan") as f:
                wchan = f.read()
            out.append(f"{p} {proc_state(p)} {wchan}: {cmdline(p)[:160]}")
    return out


def zombies_below(root: int) -> list[int]:
    """Zombie processes among the descendants of ``root`` (unreaped children)."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = parent_of(int(name))
            if ppid is not None:
                kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            todo.append(c)
            if proc_state(c) == "Z":
                out.append(c)
    return out


def empty_dumps(run_dir: str) -> list[str]:
    d = os.path.join(run_dir, "stacks")
    if not os.path.isdir(d):
        return []
    return [n for n in os.listdir(d) if os.path.getsize(os.path.join(d, n)) == 0]


def metric_steps(path: str) -> list[int]:
    return [int(r["step"]) for r in read_metrics(path)]


def metrics(path: str) -> list[dict[str, Any]]:
    return read_metrics(path)


def reference_losses(steps: int, world: int) -> list[float]:
    """Rank 0's loss per step of an uninterrupted elastic_train.py run on ``world`` ranks,
    computed in this process: the same seeds and data, gradients summed over the ranks (as
    gloo's all-reduce does for 2 ranks: a + b is exact and commutative) and divided by the
    world size. A resumed run must log exactly these values."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        grads = []
        for rank in range(world):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(8, 4, generator=g)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            grads.append([cast(torch.Tensor, p.grad).clone() for p in model.parameters()])
            if rank == 0:
                out.append(loss.item())
        for i, p in enumerate(model.parameters()):
            total = grads[0][i]
            for g_r in grads[1:]:
                total = total + g_r[i]
            p.grad = total / world
        opt.step()
    return out
