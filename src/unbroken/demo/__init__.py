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
from collections import Counter
from typing import Any

import torch

from unbroken.ckpt import read_checkpoint
from unbroken.metrics import read_metrics

__all__ = ["compare_runs", "run_demo", "run_training", "run_until"]


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
    return run_until(_train_cmd(run_dir, steps, seed, extra or []), run_dir,
                     kill_at=kill_at, timeout=timeout)


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


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, list | tuple):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}/{i}"))
        return out
    return {prefix: obj}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


def _scalar(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, int | float | str | bool)


def _is_float(v: Any) -> bool:
    # Float *tensors* hold what data and reductions produce; Python floats in a state dict
    # are hyperparameters and schedules (lr, betas), which must match on any world size.
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


def compare_runs(
    ref_dir: str,
    run_dir: str,
    *,
    ckpt: str = "ckpt",
    metrics: str = "metrics.jsonl",
    floats: bool = True,
) -> dict[str, Any]:
    """Compare final checkpoints and logs of two runs; returns a dict of findings.

    ``ckpt`` and ``metrics`` are the checkpoint root and metric log, relative to each run
    directory. ``floats=False`` leaves floating-point tensors of the final state out (runs on
    different world sizes round differently; Python floats such as learning rates are kept) and counts them in ``skipped_float_leaves``.
    Keys: one per TrainState component (``model``, ``optimizer``, ...: the
    differing flattened keys, ``[]`` when equal), ``counters`` (differing step/sample/token
    counters), ``first_loss_diff`` (step), ``loss_at_diff`` (reference, run),
    ``first_sample_diff`` (index into the concatenated sample ids), ``first_sample_step``
    (the run's step holding it), ``first_sample_ids`` (reference id, run id; None past the
    end), ``ids_logged`` (both logs hold sample ids; else the order is not compared), ``missing_samples`` / ``extra_samples`` (multiset differences: never consumed /
    consumed more often than in the reference), ``duplicated_steps``, ``identical``; ``scalar_diffs`` maps ``part/key`` of differing
    scalars (counters such as an optimizer's ``step`` or a scheduler's ``last_epoch``) to
    (reference, run) values.
    """
    ref = read_checkpoint(os.path.join(ref_dir, ckpt))
    got = read_checkpoint(os.path.join(run_dir, ckpt))
    result: dict[str, Any] = {}
    scalars: dict[str, tuple[Any, Any]] = {}
    skipped = 0
    comps = sorted(ref["components"].keys() | got["components"].keys())
    for part in comps:
        if part not in ref["components"] or part not in got["components"]:
            result[part] = ["<component missing in one run>"]
            continue
        fa = _flat(ref["components"][part])
        fb = _flat(got["components"][part])
        if not floats:
            keep = {k for k in fa.keys() | fb.keys()
                    if not (_is_float(fa.get(k)) or _is_float(fb.get(k)))}
            skipped += len(fa.keys() | fb.keys()) - len(keep)
            fa = {k: v for k, v in fa.items() if k in keep}
            fb = {k: v for k, v in fb.items() if k in keep}
        diff = sorted(
            k
            for k in fa.keys() | fb.keys()
            if k not in fa or k not in fb or not _equal(fa[k], fb[k])
        )
        result[part] = diff
        for k in diff:
            if k in fa and k in fb and _scalar(fa[k]) and _scalar(fb[k]):
                scalars[part + k] = (_plain(fa[k]), _plain(fb[k]))
    result["scalar_diffs"] = scalars
    result["skipped_float_leaves"] = skipped
    ca, cb = ref.get("counters", {}), got.get("counters", {})
    result["counters"] = sorted(k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))
    ra, rb = (
        read_metrics(os.path.join(ref_dir, metrics)),
        read_metrics(os.path.join(run_dir, metrics)),
    )
    steps_b = [r["step"] for r in rb]
    result["duplicated_steps"] = len(steps_b) - len(set(steps_b))
    pair = next(((x, y) for x, y in zip(ra, rb, strict=False) if x["loss"] != y["loss"]), None)
    result["first_loss_diff"] = pair[0]["step"] if pair else None
    result["loss_at_diff"] = (pair[0]["loss"], pair[1]["loss"]) if pair else None
    if len(ra) != len(rb) and result["first_loss_diff"] is None:
        result["first_loss_diff"] = min(len(ra), len(rb)) + 1
    # sample ids are optional in a metric log: without them the data order is not compared
    # (the loader's position is still part of the final state)
    result["ids_logged"] = all("ids" in r for r in ra + rb) and bool(ra)
    ids_a = [i for r in ra for i in r.get("ids", ())]
    ids_b = [i for r in rb for i in r.get("ids", ())]
    step_of = [r["step"] for r in rb for _ in r.get("ids", ())]
    first = next((n for n, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), None)
    if len(ids_a) != len(ids_b) and first is None:
        first = min(len(ids_a), len(ids_b))
    result["first_sample_diff"] = first
    result["first_sample_step"] = None
    result["first_sample_ids"] = None
    if first is not None:
        result["first_sample_step"] = step_of[first] if first < len(step_of) else None
        result["first_sample_ids"] = (
            ids_a[first] if first < len(ids_a) else None,
            ids_b[first] if first < len(ids_b) else None,
        )
    na, nb = Counter(ids_a), Counter(ids_b)
    result["missing_samples"] = sum((na - nb).values())
    result["extra_samples"] = sum((nb - na).values())
    result["identical"] = (
        not any(result[p] for p in comps)
        and not result["counters"]
        and result["first_loss_diff"] is None
        and result["first_sample_diff"] is None
        and result["duplicated_steps"] == 0
    )
    return result


def run_demo(work_dir: str, *, steps: int = 200, seed: int = 0) -> int:
    """The main job of ``make demo``; returns 0 when the resumed run is bit-identical."""
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
    print(f"[0/3] packed the corpus into {len(shards)} tar shards + index in {data_dir} "
          f"({time.perf_counter() - t0:.1f} s)")
    data = ["--data", data_dir]
    print(f"[1/3] reference run (no faults) in {ref_dir} ...", flush=True)
    rc, t_ref = run_training(ref_dir, steps, seed, data)
    if rc != 0:
        print(f"reference run failed (exit {rc}); see {ref_dir}/train.log")
        return 1
    print(f"      done in {t_ref:.1f} s")
    print(f"[2/3] same run, SIGKILL at step {kill_at} ...", flush=True)
    rc, t_kill = run_training(run_dir, steps, seed, data, kill_at=kill_at)
    if rc != -signal.SIGKILL:
        print(f"expected the run to die of SIGKILL, it exited {rc}; see {run_dir}/train.log")
        return 1
    print(
        f"      killed (exit {rc}) after {t_kill:.1f} s; relaunching on the same directory ...",
        flush=True,
    )
    rc, t_res = run_training(run_dir, steps, seed, data)
    if rc != 0:
        print(f"resumed run failed (exit {rc}); see {run_dir}/train.log")
        return 1
    print(f"      resumed and finished in {t_res:.1f} s")
    print("[3/3] comparing final state, loss curve and data order ...")
    res = compare_runs(ref_dir, run_dir)
    timings = _timings(os.path.join(run_dir, "train.log"))
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
    width = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    verdict = "BIT-IDENTICAL" if res["identical"] else "NOT identical"
    print(f"result: resumed run is {verdict} to the uninterrupted run (killed at step {kill_at})")
    return 0 if res["identical"] else 1


def _timings(log_path: str) -> dict[str, str]:
    saves: list[float] = []
    restore = None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "checkpointer: saved step " in line:
                saves.append(float(line.rsplit(" in ", 1)[1].split(" s")[0]))
            elif "checkpointer: restored step " in line:
                restore = line.rsplit(" in ", 1)[1].strip()
    out = {}
    if saves:
        out["save"] = f"{len(saves)} saves, median {sorted(saves)[len(saves) // 2] * 1e3:.0f} ms"
    if restore:
        out["restore"] = restore
    return out
