"""Did a resumed run end where an uninterrupted one ends? Compare two runs' final checkpoints
and metric logs: every TrainState component tensor by tensor, the counters, the loss curve and
the sample ids each step consumed (missing, duplicated, reordered). The demo and the fire drill
judge with it.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch

from unbroken.ckpt.verify import read_checkpoint
from unbroken.common.metrics import read_metrics

__all__ = ["compare_runs"]


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
    result, comps = _compare_state(ref, got, floats)
    ra = read_metrics(os.path.join(ref_dir, metrics))
    rb = read_metrics(os.path.join(run_dir, metrics))
    result.update(_compare_logs(ra, rb))
    result["identical"] = (
        not any(result[p] for p in comps)
        and not result["counters"]
        and result["first_loss_diff"] is None
        and result["first_sample_diff"] is None
        and result["duplicated_steps"] == 0
    )
    return result


def _compare_state(
    ref: dict[str, Any], got: dict[str, Any], floats: bool
) -> tuple[dict[str, Any], list[str]]:
    """Per component the differing flattened keys, scalar diffs, counters; the components."""
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
            keep = {
                k
                for k in fa.keys() | fb.keys()
                if not (_is_float(fa.get(k)) or _is_float(fb.get(k)))
            }
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
    return result, comps


def _compare_logs(ra: list[dict[str, Any]], rb: list[dict[str, Any]]) -> dict[str, Any]:
    """Loss curve and consumed sample ids of the reference log ``ra`` vs the run's ``rb``."""
    result: dict[str, Any] = {}
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
    return result
