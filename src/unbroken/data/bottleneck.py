"""Bottleneck report: run each stage of the input pipeline alone and name the one that limits.

Stages, in the order a sample meets them::

    shard read -> decode/transform -> collate      (inside each DataLoader worker)
    -> worker transport -> pin                     (in the training process)
    -> h2d                                         (copy engine)

Worker stages run one after another inside a worker, so a worker delivers
``1 / sum(1 / rate_i)`` samples/s and ``num_workers`` workers (at most one per core) deliver
that many times more. Transport, pin and H2D each run on their own thread or engine, so the
pipeline delivers the minimum of the worker group and those three. The report compares that
with the consumer's rate (the model: measured from a step timeline, or ``--consume-rate``),
names the stage that limits, and suggests ``num_workers`` and ``prefetch_factor``.

``data_bench.json`` (written by ``unbroken data bench --out RUN_DIR``) is
:meth:`BottleneckReport.to_json`; ``unbroken data report`` plots it.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from unbroken.data._transport import (
    RingReceiver,
    RingSender,
    Ticket,
    transport_available,
    worker_fds,
)
from unbroken.data.prefetch import batch_nbytes, map_tensors

__all__ = [
    "BENCH_FILE",
    "STAGES",
    "BottleneckReport",
    "StageResult",
    "analyse",
    "basic_decode",
    "bench_dataset",
    "consume_rate_from_timeline",
    "load_report",
    "measure_stages",
    "resolve_transform",
    "run_bench",
]

BENCH_FILE = "data_bench.json"
STAGES = ("shard read", "decode", "collate", "transport", "pin", "h2d")
_WORKER_STAGES = ("shard read", "decode", "collate")
_HEADROOM = 1.2  # suggest workers for 20% more than the consumer eats: rates jitter


@dataclass(frozen=True)
class StageResult:
    """One stage measured alone. ``samples_per_s`` is ``inf`` for a stage that does nothing
    (no decode given) and ``nan`` for one that could not run here (no CUDA)."""

    name: str
    where: str
    """``worker`` (runs inside each DataLoader worker), ``main`` or ``device``."""
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

    def stage(self, name: str) -> StageResult:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages are {[s.name for s in self.stages]}")

    def format(self) -> str:
        rows = [f"{'stage':<12} {'where':<7} {'samples/s':>12} {'MB/s':>9}  note"]
        for s in self.stages:
            rate = (
                "skipped" if math.isnan(s.samples_per_s)
                else "-" if math.isinf(s.samples_per_s) else f"{s.samples_per_s:,.0f}"
            )
            mb = f"{s.mb_per_s:,.1f}" if math.isfinite(s.mb_per_s) else ""
            mark = "  <- limits" if s.name == self.limiting else ""
            rows.append(f"{s.name:<12} {s.where:<7} {rate:>12} {mb:>9}  {s.note}{mark}")
        nw = max(1, min(self.num_workers, self.cpu_count))
        rows.append(
            f"{'workers':<12} {'x' + str(nw):<7} {self.worker_rate * nw:>12,.0f} {'':>9}  "
            f"{self.worker_rate:,.0f}/s per worker"
        )
        rows.append(f"{'pipeline':<12} {'':<7} {self.pipeline_rate:>12,.0f}")
        if self.consume_rate is not None:
            rows.append(f"{'consumer':<12} {'model':<7} {self.consume_rate:>12,.0f}")
        rows.append("")
        rows.append(f"bottleneck: {self.bottleneck}")
        rows.extend(self.advice)
        rows.append(
            f"suggest: num_workers={self.suggested_workers} "
            f"prefetch_factor={self.suggested_prefetch_factor}"
        )
        return "\n".join(rows)

    def metrics(self, prefix: str = "bench/") -> dict[str, float]:
        """Per-stage rates for a metric log (finite values only)."""
        out = {f"{prefix}{s.name.replace(' ', '_')}_samples_per_s": s.samples_per_s
               for s in self.stages if s.measured}
        out[f"{prefix}pipeline_samples_per_s"] = self.pipeline_rate
        if self.consume_rate is not None:
            out[f"{prefix}consume_samples_per_s"] = self.consume_rate
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [
            {**asdict(s), "samples_per_s": _json_float(s.samples_per_s),
             "mb_per_s": _json_float(s.mb_per_s)}
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
                s["name"], s["where"],
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
) -> BottleneckReport:
    """Combine per-stage rates into the pipeline rate, the limiting stage and suggestions."""
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0")
    if consume_rate is not None and not consume_rate > 0:
        raise ValueError(f"consume_rate={consume_rate} must be > 0 samples/s (or None)")
    cores = cpu_count or _cpu_count()
    by = {s.name: s for s in stages}
    worker = [by[n] for n in _WORKER_STAGES if n in by and by[n].measured]
    per_sample = sum(1.0 / s.samples_per_s for s in worker if s.samples_per_s > 0)
    worker_rate = 1.0 / per_sample if per_sample > 0 else math.inf
    # num_workers=0: the training process does the worker stages itself, on one core.
    eff = max(1, min(num_workers, cores))
    candidates: list[tuple[float, str]] = []
    if worker:
        slowest = max(worker, key=lambda s: 1.0 / s.samples_per_s)
        candidates.append((worker_rate * eff, slowest.name))
    for name in ("transport", "pin", "h2d"):
        s = by.get(name)
        if s is not None and s.measured and not (name == "transport" and num_workers == 0):
            candidates.append((s.samples_per_s, name))
    if not candidates:
        raise ValueError("no stage was measured; nothing to analyse")
    pipeline_rate, limiting = min(candidates)
    main_ceiling = min((r for r, n in candidates if n not in _WORKER_STAGES), default=math.inf)

    advice: list[str] = []
    cap = max(1, cores - 1)  # leave a core to the training process
    target = consume_rate * _HEADROOM if consume_rate is not None else main_ceiling
    if math.isfinite(target) and math.isfinite(worker_rate):
        want = max(1, math.ceil(target / worker_rate))
    else:
        want = cap
    workers = min(want, cap)
    if consume_rate is None:
        bottleneck = limiting
        advice.append(
            f"pipeline capacity {pipeline_rate:,.0f} samples/s, limited by {limiting}; give the "
            "model's rate (--consume-rate, or a step timeline) to know whether it stalls"
        )
    elif pipeline_rate >= consume_rate:
        bottleneck = "no data stall"
        advice.append(
            f"the pipeline delivers {pipeline_rate:,.0f} samples/s, "
            f"{pipeline_rate / consume_rate:.1f}x the consumer's {consume_rate:,.0f}; "
            f"{limiting} would limit first"
        )
    else:
        bottleneck = limiting
        advice.append(
            f"data-bound: {limiting} limits the pipeline to {pipeline_rate:,.0f} samples/s, "
            f"{100 * pipeline_rate / consume_rate:.0f}% of the consumer's {consume_rate:,.0f}"
        )
    if limiting in _WORKER_STAGES and want > cap and bottleneck != "no data stall":
        advice.append(
            f"even {cap} workers (cores - 1) deliver only {worker_rate * cap:,.0f} samples/s: "
            f"make {limiting} cheaper (decode once at pack time, smaller images, augment on "
            "the GPU with DevicePrefetcher(transform=...))"
        )
    elif bottleneck == "no data stall":
        pass
    elif limiting == "transport":
        advice.append("transport limits: return tensors (shared memory) rather than Python "
                      "objects or bytes from the workers, and collate in the worker")
    elif limiting == "pin":
        advice.append("pin limits: pinning copies every batch once more; send smaller dtypes "
                      "(uint8 images, int32 tokens) and convert on the GPU")
    elif limiting == "h2d":
        advice.append("h2d limits: copy fewer bytes (uint8 instead of float32, normalise on "
                      "the GPU) and make sure batches are pinned (pin_memory=True)")
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
        suggested_workers=workers,
        suggested_prefetch_factor=_prefetch_factor(worker_batch_ms),
        advice=tuple(advice),
    )


def _prefetch_factor(worker_batch_ms: np.ndarray | None) -> int:
    # Each worker buffers prefetch_factor batches; enough to ride out a batch that takes the
    # 95th-percentile time instead of the median one.
    if worker_batch_ms is None or worker_batch_ms.size < 4:
        return 2
    p50, p95 = np.percentile(worker_batch_ms, [50, 95])
    if p50 <= 0:
        return 2
    return int(min(8, max(2, math.ceil(p95 / p50) + 1)))


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# -- measurement ---------------------------------------------------------------------------


def _payload_bytes(sample: Any) -> int:
    if isinstance(sample, (bytes, bytearray, memoryview)):
        return len(sample)
    if isinstance(sample, np.ndarray):
        return int(sample.nbytes)
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    if isinstance(sample, dict):
        return sum(_payload_bytes(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(_payload_bytes(v) for v in sample)
    return 0


class _Repeat(IterableDataset):
    """Yields a fresh copy of one pre-built batch ``n`` times: the worker only sends it,
    through the shared-memory ring ``StatefulLoader`` uses when ``slots`` > 0.

    Fresh storage each time, because torch sends an already shared tensor as a bare handle,
    which would flatter the transport rate.
    """

    def __init__(self, batch: Any, n: int, slots: int, fds: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self.batch, self.n, self.slots, self.fds = batch, n, slots, fds

    def __iter__(self) -> Iterator[Any]:
        send: Callable[[Any], Any] = lambda b: b  # noqa: E731
        if self.slots and get_worker_info() is not None:
            send = RingSender(self.slots, fd_spec=self.fds[0] if self.fds else None).pack
        for _ in range(self.n):
            yield send(map_tensors(torch.clone, self.batch))


def _rate(samples: int, ns: int) -> float:
    return samples / (ns / 1e9) if ns > 0 else math.inf


def measure_stages(
    read_batch: Callable[[int], list[Any]],
    *,
    batch_size: int,
    num_batches: int,
    decode: Callable[[Any], Any] | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    device: str | None = None,
    max_seconds: float = 20.0,
    transport: bool = True,
) -> tuple[list[StageResult], np.ndarray]:
    """Time each stage alone on the same batches; returns the stages and the per-batch
    worker time (read + decode + collate, ms) for the prefetch-factor suggestion.

    ``read_batch(b)`` returns batch ``b``'s raw samples (the shard-read stage). Reading
    stops after ``num_batches`` or ``max_seconds / 3`` (at least 2 batches), so a slow
    stage cannot run the bench for long.
    """
    if num_batches < 2:
        raise ValueError(f"num_batches={num_batches} must be >= 2")
    collate = collate or default_collate
    clock = time.perf_counter_ns
    budget = int(max_seconds / 3 * 1e9)
    raw: list[list[Any]] = []
    read_ns: list[int] = []
    t_start = clock()
    for b in range(num_batches):
        t0 = clock()
        raw.append(read_batch(b))
        read_ns.append(clock() - t0)
        if b >= 1 and clock() - t_start > budget:
            break
    n_samples = sum(len(r) for r in raw)
    raw_bytes = sum(_payload_bytes(s) for r in raw for s in r)
    results = [StageResult("shard read", "worker", _rate(n_samples, sum(read_ns)),
                           raw_bytes / (sum(read_ns) / 1e9) / 1e6 if sum(read_ns) else math.nan,
                           f"{len(raw)} batches of {batch_size}")]

    decoded = raw
    dec_ns = [0] * len(raw)
    if decode is None:
        results.append(StageResult("decode", "worker", math.inf, note="no decode/transform"))
    else:
        decoded = []
        for i, r in enumerate(raw):
            t0 = clock()
            decoded.append([decode(s) for s in r])
            dec_ns[i] = clock() - t0
        results.append(StageResult("decode", "worker", _rate(n_samples, sum(dec_ns)),
                                   note=getattr(decode, "__name__", "transform")))

    batches: list[Any] = []
    col_ns = [0] * len(raw)
    for i, d in enumerate(decoded):
        t0 = clock()
        batches.append(collate(d))
        col_ns[i] = clock() - t0
    results.append(StageResult("collate", "worker", _rate(n_samples, sum(col_ns)),
                               note=getattr(collate, "__name__", "collate")))
    # The first batch pays for opening shards and building the order: not jitter.
    worker_ms = (np.asarray(read_ns) + np.asarray(dec_ns) + np.asarray(col_ns))[1:] / 1e6
    nbytes = _payload_bytes(batches[0])
    results.append(_measure_transport(batches[0], batch_size, nbytes, budget)
                   if transport else StageResult("transport", "main", math.nan, note="not run"))
    results.extend(_measure_device(batches, batch_size, device))
    return results, worker_ms


def _measure_transport(batch: Any, batch_size: int, nbytes: int, budget_ns: int) -> StageResult:
    # One worker sends the same collated batch over and over: what the main process pays
    # to receive a batch (unpickling, shared-memory mapping) without any worker work.
    n, prefetch = 256, 4
    ring = transport_available()
    fds = worker_fds(1) if ring else []
    slots = prefetch + 2 if ring else 0  # as StatefulLoader sizes it for one worker
    loader = DataLoader(_Repeat(batch, n, slots, fds), batch_size=None, num_workers=1,
                        prefetch_factor=prefetch)
    rx = RingReceiver(fds)
    clock = time.perf_counter_ns
    got = 0
    t0 = -1
    tickets = 0
    for item in loader:
        tickets += isinstance(item, Ticket)
        rx.unpack(item)
        if t0 < 0:
            t0 = clock()  # worker start-up excluded
            continue
        got += 1
        if clock() - t0 > budget_ns:
            break
    ns = clock() - t0
    rx.close()
    # the ring leaves batches holding tensors to torch's shared-memory hand-off
    how = "shared-memory ring" if tickets else "torch's pipe"
    return StageResult("transport", "main", _rate(got * batch_size, ns),
                       nbytes * got / (ns / 1e9) / 1e6 if got and ns > 0 else math.nan,
                       f"1 worker, {how}, collated batch, fresh copy each")


def _measure_device(batches: list[Any], batch_size: int, device: str | None) -> list[StageResult]:
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        why = "no CUDA device" if dev is None or dev.type == "cuda" else f"device {dev}"
        return [StageResult("pin", "main", math.nan, note=why),
                StageResult("h2d", "device", math.nan, note=why)]
    nbytes = sum(batch_nbytes(b) for b in batches)
    samples = batch_size * len(batches)
    t0 = time.perf_counter_ns()
    pinned = [map_tensors(lambda t: t.pin_memory(), b) for b in batches]
    pin_ns = time.perf_counter_ns() - t0
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):  # warm-up: allocator and copy engine
        map_tensors(lambda t: t.to(dev, non_blocking=True), pinned[0])
    stream.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        out = [map_tensors(lambda t: t.to(dev, non_blocking=True), b) for b in pinned]
        end.record(stream)
    end.synchronize()
    h2d_s = start.elapsed_time(end) / 1e3
    del out
    return [
        StageResult("pin", "main", _rate(samples, pin_ns), nbytes / (pin_ns / 1e9) / 1e6,
                    "pin_memory() of collated batches"),
        StageResult("h2d", "device", samples / h2d_s if h2d_s > 0 else math.inf,
                    nbytes / h2d_s / 1e6 if h2d_s > 0 else math.nan,
                    f"pinned, non_blocking, {dev}"),
    ]


# -- a dataset directory -------------------------------------------------------------------


_IMAGE_EXTS = {"jpg", "jpeg", "png", "webp", "ppm", "bmp", "gif", "tif", "tiff"}


def basic_decode(sample: Any) -> Any:
    """Decode a tar sample's members by extension (``json``, ``txt``, ``cls``, ``npy``,
    ``pt``, images via Pillow when installed); other members stay bytes. Token samples
    (arrays) pass through. A stand-in for the user's own transform in ``data bench``."""
    if not isinstance(sample, dict):
        return sample
    out: dict[str, Any] = {}
    for key, value in sample.items():
        ext = key.rsplit(".", 1)[-1].lower()
        if not isinstance(value, (bytes, bytearray)) or key == "__key__":
            out[key] = value
        elif ext == "json":
            out[key] = json.loads(value)
        elif ext in ("txt", "text"):
            out[key] = value.decode("utf-8")
        elif ext in ("cls", "cls2", "id", "index"):
            out[key] = int(value)
        elif ext == "npy":
            out[key] = torch.from_numpy(np.load(io.BytesIO(value), allow_pickle=False))
        elif ext in ("pt", "pth"):
            out[key] = torch.load(io.BytesIO(value), weights_only=True)
        elif ext in _IMAGE_EXTS:
            out[key] = _decode_image(bytes(value))
        else:
            out[key] = value
    return out


def _decode_image(data: bytes) -> Any:
    try:
        from PIL import Image
    except ImportError:
        return data
    with Image.open(io.BytesIO(data)) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB"))).permute(2, 0, 1).contiguous()


def bench_dataset(
    root: str,
    *,
    batch_size: int = 32,
    num_workers: int = 2,
    consume_rate: float | None = None,
    transform: Callable[[Any], Any] | None = basic_decode,
    collate: Callable[[list[Any]], Any] | None = None,
    seq_len: int | None = None,
    device: str | None = None,
    num_batches: int = 50,
    max_seconds: float = 20.0,
    seed: int = 0,
) -> BottleneckReport:
    """Measure every stage on a packed dataset directory (tar or token shards) and analyse.

    Shard read is :meth:`StreamingDataset.read` on the shuffled epoch-0 order (the real
    window-local read path), without its transform; ``transform`` is then timed alone.
    """
    from unbroken.data.dataset import StreamingDataset

    ds = StreamingDataset(root, seed=seed, seq_len=seq_len, rank=0, world_size=1)
    part = ds.partition(0, batch_size, "drop")
    total = part.num_batches()
    if total < 2:
        raise ValueError(
            f"{root}: {ds.epoch_length} samples make {total} batch(es) of {batch_size}; the "
            "bench needs at least 2 - pass a smaller --batch-size"
        )
    stages, worker_ms = measure_stages(
        lambda b: ds.read(0, part.batch_positions(b)),
        batch_size=batch_size,
        num_batches=min(num_batches, total),
        decode=transform,
        collate=collate,
        device=device,
        max_seconds=max_seconds,
    )
    return analyse(stages, batch_size=batch_size, num_workers=num_workers,
                   consume_rate=consume_rate, worker_batch_ms=worker_ms)


def resolve_transform(spec: str | None) -> Callable[[Any], Any] | None:
    """``"basic"`` -> :func:`basic_decode`, ``"none"``/None -> no transform,
    ``"pkg.module:function"`` -> that function (imported)."""
    if spec is None or spec == "none":
        return None
    if spec == "basic":
        return basic_decode
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ValueError(
            f"--transform {spec!r}: expected 'basic', 'none' or 'package.module:function'"
        )
    import importlib

    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--transform {spec!r}: cannot import it ({e})") from e
    if not callable(fn):
        raise ValueError(f"--transform {spec!r} is not callable")
    return fn


def consume_rate_from_timeline(path: str, batch_size: int | None) -> float:
    """samples/s the model ate in a recorded run: batch size / median compute time of a step."""
    from unbroken.data.profile import load_timeline

    tl = load_timeline(path)
    bs = tl.batch_size or batch_size
    if not bs:
        raise ValueError(f"{path}: the timeline does not record the batch size; pass --batch-size")
    comp = float(np.median(tl.compute_ms)) if tl.compute_ms.size else 0.0
    if comp <= 0:
        raise ValueError(f"{path}: no compute time recorded; cannot derive the consumer's rate")
    return bs / (comp / 1e3)


def run_bench(
    root: str,
    *,
    batch_size: int = 32,
    num_workers: int | None = None,
    consume_rate: float | None = None,
    timeline: str | None = None,
    transform: str | None = "basic",
    seq_len: int | None = None,
    device: str | None = None,
    num_batches: int = 50,
    max_seconds: float = 20.0,
    seed: int = 0,
    out: str | None = None,
    metrics: str | None = None,
    metrics_step: int = 0,
) -> tuple[BottleneckReport, str | None]:
    """What ``unbroken data bench`` does: returns the report and the JSON path written."""
    if consume_rate is not None and timeline is not None:
        raise ValueError("give the consumer's rate once: --consume-rate or --timeline, not both")
    if timeline is not None:
        consume_rate = consume_rate_from_timeline(timeline, batch_size)
    if device is None and torch.cuda.is_available():
        device = "cuda"
    report = bench_dataset(
        root,
        batch_size=batch_size,
        num_workers=max(1, _cpu_count() - 1) if num_workers is None else num_workers,
        consume_rate=consume_rate,
        transform=resolve_transform(transform),
        seq_len=seq_len,
        device=device,
        num_batches=num_batches,
        max_seconds=max_seconds,
        seed=seed,
    )
    path = None
    if out is not None:
        from unbroken._fs import atomic_write_bytes

        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, BENCH_FILE)
        atomic_write_bytes(path, json.dumps(report.to_json(), indent=1).encode())
    if metrics is not None:
        from unbroken.metrics import MetricLog

        mlog = MetricLog(metrics)
        try:
            mlog.log(metrics_step, **report.metrics())
        finally:
            mlog.close()
    return report, path
