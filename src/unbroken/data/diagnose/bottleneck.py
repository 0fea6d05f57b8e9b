"""Bottleneck report: which stage of the input pipeline limits, and what to do about it.

Stages, in the order a sample meets them: network (remote datasets) -> shard read ->
decode/transform -> collate (inside each DataLoader worker) -> worker transport -> pin
(in the training process) -> h2d (copy engine). They are measured by
:mod:`unbroken.data.diagnose.bench`; :func:`analyse` compares what the pipeline delivers with
the consumer's rate (measured from a step timeline, or ``--consume-rate``), names the stage
that limits, and suggests ``num_workers``, ``prefetch_factor`` and, for a remote dataset,
the prefetch depth.

``data_bench.json`` (written by ``unbroken data bench --out RUN_DIR``) is
:meth:`BottleneckReport.to_json`; ``unbroken data report`` plots it.

The pipeline's rate model and the prefetch-depth rule: ARCHITECTURE.md, "Design notes" >
data > the bottleneck report.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from unbroken.common.tables import render_table

__all__ = [
    "BENCH_FILE",
    "STAGES",
    "BottleneckReport",
    "StageResult",
    "analyse",
    "usable_cpus",
    "load_report",
]

BENCH_FILE = "data_bench.json"
STAGES = ("network", "shard read", "decode", "collate", "transport", "pin", "h2d")
_WORKER_STAGES = ("shard read", "decode", "collate")
_HEADROOM = 1.2  # suggest workers for 20% more than the consumer eats: rates jitter


@dataclass(frozen=True)
class StageResult:
    """One stage measured alone. ``samples_per_s`` is ``inf`` for a stage that does nothing
    (no decode given) and ``nan`` for one that could not run here (no CUDA)."""

    name: str
    where: str
    """``worker`` (runs inside each DataLoader worker), ``main``, ``device`` or ``remote``
    (the node's downloads of a remote dataset)."""
    samples_per_s: float
    mb_per_s: float = float("nan")
    note: str = ""

    @property
    def measured(self) -> bool:
        return math.isfinite(self.samples_per_s)


@dataclass(frozen=True)
class BottleneckReport:
    """The arithmetic of :func:`analyse`; ``format()`` is the table the CLI prints."""

    stages: tuple[StageResult, ...]
    batch_size: int
    num_workers: int
    cpu_count: int
    consume_rate: float | None
    worker_rate: float
    """samples/s one worker delivers (all worker stages in sequence)."""
    pipeline_rate: float
    """samples/s the whole pipeline delivers with ``num_workers``."""
    limiting: str
    """The stage that limits the pipeline."""
    bottleneck: str
    """``"no data stall"`` when the pipeline outpaces the consumer, else the limiting stage."""
    suggested_workers: int
    suggested_prefetch_factor: int
    advice: tuple[str, ...] = field(default_factory=tuple)
    suggested_prefetch_shards: int | None = None
    """Remote datasets: ``CacheConfig(prefetch_shards=...)``; None for local data."""

    def stage(self, name: str) -> StageResult:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages are {[s.name for s in self.stages]}")

    def format(self) -> str:
        table: list[tuple[str, str, str, str, str]] = []
        for s in self.stages:
            rate = (
                "skipped"
                if math.isnan(s.samples_per_s)
                else "-"
                if math.isinf(s.samples_per_s)
                else f"{s.samples_per_s:,.0f}"
            )
            mb = f"{s.mb_per_s:,.1f}" if math.isfinite(s.mb_per_s) else ""
            mark = "  <- limits" if s.name == self.limiting else ""
            table.append((s.name, s.where, rate, mb, s.note + mark))
        nw = max(1, min(self.num_workers, self.cpu_count))
        table.append(
            (
                "workers",
                f"x{nw}",
                f"{self.worker_rate * nw:,.0f}",
                "",
                f"{self.worker_rate:,.0f}/s per worker",
            )
        )
        table.append(("pipeline", "", f"{self.pipeline_rate:,.0f}", "", ""))
        if self.consume_rate is not None:
            table.append(("consumer", "model", f"{self.consume_rate:,.0f}", "", ""))
        header = ("stage", "where", "samples/s", "MB/s", "note")
        rows = [render_table(table, header=header, right={2, 3})]
        rows.append("")
        rows.append(f"bottleneck: {self.bottleneck}")
        rows.extend(self.advice)
        shards = (
            ""
            if self.suggested_prefetch_shards is None
            else f" CacheConfig(prefetch_shards={self.suggested_prefetch_shards})"
        )
        rows.append(
            f"suggest: num_workers={self.suggested_workers} "
            f"prefetch_factor={self.suggested_prefetch_factor}{shards}"
        )
        return "\n".join(rows)

    def metrics(self, prefix: str = "bench/") -> dict[str, float]:
        """Per-stage rates for a metric log (finite values only)."""
        out = {
            f"{prefix}{s.name.replace(' ', '_')}_samples_per_s": s.samples_per_s
            for s in self.stages
            if s.measured
        }
        out[f"{prefix}pipeline_samples_per_s"] = self.pipeline_rate
        if self.consume_rate is not None:
            out[f"{prefix}consume_samples_per_s"] = self.consume_rate
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [
            {
                **asdict(s),
                "samples_per_s": _json_float(s.samples_per_s),
                "mb_per_s": _json_float(s.mb_per_s),
            }
            for s in self.stages
        ]
        d["advice"] = list(self.advice)
        return d


def _json_float(v: float) -> float | str | None:
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf"
    return v


def load_report(path: str) -> BottleneckReport:
    """Read ``data_bench.json`` (a file or the run directory holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, BENCH_FILE)
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    try:
        stages = tuple(
            StageResult(
                s["name"],
                s["where"],
                float("nan") if s["samples_per_s"] is None else float(s["samples_per_s"]),
                float("nan") if s["mb_per_s"] is None else float(s["mb_per_s"]),
                s.get("note", ""),
            )
            for s in d.pop("stages")
        )
        d["advice"] = tuple(d.get("advice", ()))
        return BottleneckReport(stages=stages, **d)
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: not a data_bench.json written by `unbroken data bench` ({e!r})"
        ) from e


# -- analysis (pure arithmetic) ------------------------------------------------------------


def analyse(
    stages: tuple[StageResult, ...] | list[StageResult],
    *,
    batch_size: int,
    num_workers: int,
    consume_rate: float | None = None,
    cpu_count: int | None = None,
    worker_batch_ms: np.ndarray | None = None,
    prefetch_hint: tuple[float, float, int] | None = None,
) -> BottleneckReport:
    """Combine per-stage rates into the pipeline rate, the limiting stage and suggestions.

    ``prefetch_hint`` (remote datasets): (seconds one shard takes to download, samples per
    shard, shards per shuffle window) for the suggested prefetch depth.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0")
    if consume_rate is not None and not consume_rate > 0:
        raise ValueError(f"consume_rate={consume_rate} must be > 0 samples/s (or None)")
    cores = cpu_count or usable_cpus()
    by = {s.name: s for s in stages}
    worker_rate, pipeline_rate, limiting, main_ceiling = _rates(by, num_workers, cores)
    cap = max(1, cores - 1)  # leave a core to the training process
    target = consume_rate * _HEADROOM if consume_rate is not None else main_ceiling
    if math.isfinite(target) and math.isfinite(worker_rate):
        want = max(1, math.ceil(target / worker_rate))
    else:
        want = cap
    bottleneck, advice = _verdict(pipeline_rate, limiting, consume_rate)
    if bottleneck != "no data stall":
        advice += _remedy(by, limiting, worker_rate, want, cap)
    return BottleneckReport(
        stages=tuple(stages),
        batch_size=batch_size,
        num_workers=num_workers,
        cpu_count=cores,
        consume_rate=consume_rate,
        worker_rate=worker_rate,
        pipeline_rate=pipeline_rate,
        limiting=limiting,
        bottleneck=bottleneck,
        suggested_workers=min(want, cap),
        suggested_prefetch_factor=_prefetch_factor(worker_batch_ms),
        advice=tuple(advice),
        suggested_prefetch_shards=_prefetch_shards(prefetch_hint, pipeline_rate, consume_rate),
    )


def _rates(
    by: dict[str, StageResult], num_workers: int, cores: int
) -> tuple[float, float, str, float]:
    """(one worker's rate, the pipeline's rate, the limiting stage, the ceiling of the stages
    outside the workers): the worker stages run in series inside each worker, the others
    side by side, so the pipeline delivers the minimum of the worker group and those."""
    worker = [by[n] for n in _WORKER_STAGES if n in by and by[n].measured]
    per_sample = sum(1.0 / s.samples_per_s for s in worker if s.samples_per_s > 0)
    worker_rate = 1.0 / per_sample if per_sample > 0 else math.inf
    # num_workers=0: the training process does the worker stages itself, on one core.
    eff = max(1, min(num_workers, cores))
    candidates: list[tuple[float, str]] = []
    if worker:
        slowest = max(worker, key=lambda s: 1.0 / s.samples_per_s)
        candidates.append((worker_rate * eff, slowest.name))
    for name in ("network", "transport", "pin", "h2d"):
        s = by.get(name)
        if s is not None and s.measured and not (name == "transport" and num_workers == 0):
            candidates.append((s.samples_per_s, name))
    if not candidates:
        raise ValueError("no stage was measured; nothing to analyse")
    pipeline_rate, limiting = min(candidates)
    main_ceiling = min((r for r, n in candidates if n not in _WORKER_STAGES), default=math.inf)
    return worker_rate, pipeline_rate, limiting, main_ceiling


def _verdict(
    pipeline_rate: float, limiting: str, consume_rate: float | None
) -> tuple[str, list[str]]:
    """The bottleneck ("no data stall" when the pipeline outruns the consumer) and the line
    that says so."""
    if consume_rate is None:
        return limiting, [
            f"pipeline capacity {pipeline_rate:,.0f} samples/s, limited by {limiting}; give the "
            "model's rate (--consume-rate, or a step timeline) to know whether it stalls"
        ]
    if pipeline_rate >= consume_rate:
        return "no data stall", [
            f"the pipeline delivers {pipeline_rate:,.0f} samples/s, "
            f"{pipeline_rate / consume_rate:.1f}x the consumer's {consume_rate:,.0f}; "
            f"{limiting} would limit first"
        ]
    return limiting, [
        f"data-bound: {limiting} limits the pipeline to {pipeline_rate:,.0f} samples/s, "
        f"{100 * pipeline_rate / consume_rate:.0f}% of the consumer's {consume_rate:,.0f}"
    ]


def _remedy(
    by: dict[str, StageResult], limiting: str, worker_rate: float, want: int, cap: int
) -> list[str]:
    """What to do about the limiting stage (nothing to add when more workers will do)."""
    if limiting in _WORKER_STAGES:
        if want <= cap:
            return []
        return [
            f"even {cap} workers (cores - 1) deliver only {worker_rate * cap:,.0f} samples/s: "
            f"make {limiting} cheaper (decode once at pack time, smaller images, augment on "
            "the GPU with DevicePrefetcher(transform=...))"
        ]
    if limiting == "network":
        net = by["network"]
        return [
            f"the network limits: downloads deliver {net.mb_per_s:,.1f} MB/s "
            f"({net.samples_per_s:,.0f} samples/s); if one stream is what limits, more parallel "
            "downloads help (CacheConfig(threads=...)); otherwise stage the dataset "
            "(`unbroken data stage`) or put the cache nearer the store"
        ]
    return [_STAGE_REMEDY[limiting]] if limiting in _STAGE_REMEDY else []


_STAGE_REMEDY = {
    "transport": "transport limits: return tensors (shared memory) rather than Python "
    "objects or bytes from the workers, and collate in the worker",
    "pin": "pin limits: pinning copies every batch once more; send smaller dtypes "
    "(uint8 images, int32 tokens) and convert on the GPU",
    "h2d": "h2d limits: copy fewer bytes (uint8 instead of float32, normalise on "
    "the GPU) and make sure batches are pinned (pin_memory=True)",
}


def _prefetch_shards(
    hint: tuple[float, float, int] | None, pipeline_rate: float, consume_rate: float | None
) -> int | None:
    # Little's law: shards in flight = shard download time x shards consumed per second; one
    # more for jitter; at least a window's shards, all needed together when readers enter it.
    if hint is None:
        return None
    unit_s, unit_samples, window = hint
    rate = min(pipeline_rate, consume_rate) if consume_rate is not None else pipeline_rate
    if not (math.isfinite(rate) and rate > 0 and unit_samples > 0):
        return max(1, window)
    return max(window, math.ceil(unit_s * rate / unit_samples) + 1)


def _prefetch_factor(worker_batch_ms: np.ndarray | None) -> int:
    # Each worker buffers prefetch_factor batches; enough to ride out a batch that takes the
    # 95th-percentile time instead of the median one.
    if worker_batch_ms is None or worker_batch_ms.size < 4:
        return 2
    p50, p95 = np.percentile(worker_batch_ms, [50, 95])
    if p50 <= 0:
        return 2
    return int(min(8, max(2, math.ceil(p95 / p50) + 1)))


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
