"""``unbroken demo``: train, SIGKILL at a random step, resume, and prove bit-identity.

1. a reference run trains the tiny GPT for ``steps`` steps without interruption;
2. a second run of the same script is SIGKILLed (a real signal, from outside) as soon as
   it reaches a randomly chosen step; the script is started again on the same directory,
   restores the newest verified checkpoint and finishes;
3. both final checkpoints are compared tensor by tensor (model, optimizer, scheduler, EMA),
   and so are the loss curves and the sample ids each step consumed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from unbroken.ckpt.compare import compare_runs
from unbroken.common.metrics import read_metrics
from unbroken.common.tables import render_table

__all__ = ["MIN_STEPS", "run_demo", "run_training", "run_until"]

MIN_STEPS = 20
"""Fewest steps ``run_demo`` takes: room for a kill after step ``steps // 5`` and 10 more."""


def _train_cmd(run_dir: str, steps: int, seed: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "unbroken.demo.train",
        "--dir",
        run_dir,
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        *extra,
    ]


def run_training(
    run_dir: str,
    steps: int,
    seed: int,
    extra: list[str] | None = None,
    *,
    kill_at: int | None = None,
    timeout: float = 600,
) -> tuple[int, float]:
    """Run the demo script once; with ``kill_at``, SIGKILL it when it logs that step.

    Returns (exit code, seconds).
    """
    return run_until(
        _train_cmd(run_dir, steps, seed, extra or []), run_dir, kill_at=kill_at, timeout=timeout
    )


def run_until(
    cmd: list[str], run_dir: str, *, kill_at: int | None = None, timeout: float = 600
) -> tuple[int, float]:
    """Run a training command whose metric log is ``run_dir/metrics.jsonl``; with
    ``kill_at``, SIGKILL it as soon as the log reaches that step. Output goes to
    ``run_dir/train.log``. Returns (exit code, seconds)."""
    t0 = time.perf_counter()
    os.makedirs(run_dir, exist_ok=True)
    log = open(os.path.join(run_dir, "train.log"), "a")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        if kill_at is not None:
            metrics = os.path.join(run_dir, "metrics.jsonl")
            while proc.poll() is None:
                recs = read_metrics(metrics)
                if recs and recs[-1]["step"] >= kill_at:
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.01)
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return rc, time.perf_counter() - t0


def run_demo(work_dir: str, *, steps: int = 200, seed: int = 0) -> int:
    """The main job of ``make demo``; returns 0 when the resumed run is bit-identical."""
    if steps < MIN_STEPS:  # the kill step is drawn from [steps // 5, steps - 10)
        raise ValueError(
            f"steps={steps}: the demo needs at least {MIN_STEPS}; pass --steps "
            f"{MIN_STEPS} or more (default 200)"
        )
    shutil.rmtree(work_dir, ignore_errors=True)
    ref_dir, run_dir = os.path.join(work_dir, "reference"), os.path.join(work_dir, "killed")
    os.makedirs(ref_dir)
    os.makedirs(run_dir)
    kill_at = random.Random(seed).randrange(steps // 5, steps - 10)
    print(
        f"unbroken demo: tiny GPT, {steps} steps, AdamW + cosine + EMA + grad-accum 2, "
        "dropout on; data: tar shards -> StreamingDataset (two-level shuffle) -> StatefulLoader"
    )
    from unbroken.demo.train import CTX, prepare_data

    data_dir = os.path.join(work_dir, "data")
    t0 = time.perf_counter()
    prepare_data(data_dir, seed, CTX)
    shards = sorted(f for f in os.listdir(data_dir) if f.endswith(".tar"))
    print(
        f"[0/3] packed the corpus into {len(shards)} tar shards + index in {data_dir} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    if not _train_and_kill(ref_dir, run_dir, steps, seed, ["--data", data_dir], kill_at):
        return 1
    print("[3/3] comparing final state, loss curve and data order ...")
    res = compare_runs(ref_dir, run_dir)
    print(render_table(_rows(res, _timings(os.path.join(run_dir, "train.log"))), indent="  "))
    verdict = "BIT-IDENTICAL" if res["identical"] else "NOT identical"
    print(f"result: resumed run is {verdict} to the uninterrupted run (killed at step {kill_at})")
    return 0 if res["identical"] else 1


def _train_and_kill(
    ref_dir: str, run_dir: str, steps: int, seed: int, data: list[str], kill_at: int
) -> bool:
    """The reference run, the same run SIGKILLed at ``kill_at``, then resumed; False (after
    saying why) when a run did not end as it should."""
    print(f"[1/3] reference run (no faults) in {ref_dir} ...", flush=True)
    rc, t_ref = run_training(ref_dir, steps, seed, data)
    if rc != 0:
        print(f"reference run failed (exit {rc}); see {ref_dir}/train.log")
        return False
    print(f"      done in {t_ref:.1f} s")
    print(f"[2/3] same run, SIGKILL at step {kill_at} ...", flush=True)
    rc, t_kill = run_training(run_dir, steps, seed, data, kill_at=kill_at)
    if rc != -signal.SIGKILL:
        print(f"expected the run to die of SIGKILL, it exited {rc}; see {run_dir}/train.log")
        return False
    print(
        f"      killed (exit {rc}) after {t_kill:.1f} s; relaunching on the same directory ...",
        flush=True,
    )
    rc, t_res = run_training(run_dir, steps, seed, data)
    if rc != 0:
        print(f"resumed run failed (exit {rc}); see {run_dir}/train.log")
        return False
    print(f"      resumed and finished in {t_res:.1f} s")
    return True


def _rows(res: dict[str, Any], timings: dict[str, str]) -> list[tuple[str, str]]:
    """The comparison's table: one row per part of the state, then the timings."""
    rows = [
        (p, "identical" if not res[p] else f"DIFFERS ({len(res[p])} entries, e.g. {res[p][0]})")
        for p in ("model", "optimizer", "scheduler", "ema", "loader")
    ]
    rows.append(
        (
            "loss curve",
            "identical"
            if res["first_loss_diff"] is None
            else f"DIFFERS from step {res['first_loss_diff']}",
        )
    )
    rows.append(
        (
            "data order",
            "identical"
            if res["first_sample_diff"] is None
            else f"DIFFERS from sample #{res['first_sample_diff']}",
        )
    )
    rows.append(
        (
            "metric log",
            "no duplicated step"
            if not res["duplicated_steps"]
            else f"{res['duplicated_steps']} duplicated steps",
        )
    )
    rows.append(("save time", timings.get("save", "n/a")))
    rows.append(("restore time", timings.get("restore", "n/a")))
    return rows


def _timings(log_path: str) -> dict[str, str]:
    saves: list[float] = []
    restore = None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "checkpointer: saved step " in line:
                saves.append(float(line.rsplit(" in ", 1)[1].split(" s")[0]))
            elif "checkpointer: resumed from step " in line:
                restore = line.rsplit(" in ", 1)[1].strip()
    out = {}
    if saves:
        out["save"] = f"{len(saves)} saves, median {sorted(saves)[len(saves) // 2] * 1e3:.0f} ms"
    if restore:
        out["restore"] = restore
    return out
