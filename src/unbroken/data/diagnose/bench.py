"""Run each stage of the input pipeline alone, on real data: ``unbroken data bench``.

:func:`measure_stages` times shard read, decode/transform and collate on the same batches,
the worker->main transport (through the shared-memory ring :class:`StatefulLoader` uses),
and pinning + host->device copies when a CUDA device is there; :func:`bench_dataset` does
it on a packed dataset directory and hands the rates to
:func:`unbroken.data.diagnose.bottleneck.analyse`; :func:`run_bench` is the CLI's entry point.

For a remote dataset (an fsspec URL) :func:`measure_network` first downloads shards through
the node cache machinery (parallel, verified) into a scratch cache: that is the ``network``
stage, and its per-shard time gives the suggested prefetch depth. The other stages then read
the downloaded shards in manifest order.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from unbroken.data.diagnose.bottleneck import (
    BENCH_FILE,
    BottleneckReport,
    StageResult,
    analyse,
    usable_cpus,
)
from unbroken.data.feed.prefetch import batch_nbytes, map_tensors
from unbroken.data.stream.transport import (
    RingReceiver,
    RingSender,
    Ticket,
    transport_available,
    worker_fds,
)

__all__ = [
    "basic_decode",
    "bench_dataset",
    "consume_rate_from_timeline",
    "measure_stages",
    "resolve_transform",
    "run_bench",
]


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


def _read_batches(
    read_batch: Callable[[int], list[Any]], num_batches: int, budget_ns: int
) -> tuple[list[list[Any]], list[int]]:
    """Batches ``0, 1, ...`` read until ``num_batches`` or the time budget (at least 2),
    and the nanoseconds each read took."""
    clock = time.perf_counter_ns
    raw: list[list[Any]] = []
    read_ns: list[int] = []
    t_start = clock()
    for b in range(num_batches):
        t0 = clock()
        raw.append(read_batch(b))
        read_ns.append(clock() - t0)
        if b >= 1 and clock() - t_start > budget_ns:
            break
    return raw, read_ns


def _timed(fn: Callable[[Any], Any], items: list[Any]) -> tuple[list[Any], list[int]]:
    """``fn`` of each item, and the nanoseconds each call took."""
    out: list[Any] = []
    ns: list[int] = []
    for item in items:
        t0 = time.perf_counter_ns()
        out.append(fn(item))
        ns.append(time.perf_counter_ns() - t0)
    return out, ns


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
    budget = int(max_seconds / 3 * 1e9)
    raw, read_ns = _read_batches(read_batch, num_batches, budget)
    n_samples = sum(len(r) for r in raw)
    raw_bytes = sum(_payload_bytes(s) for r in raw for s in r)
    results = [
        StageResult(
            "shard read",
            "worker",
            _rate(n_samples, sum(read_ns)),
            raw_bytes / (sum(read_ns) / 1e9) / 1e6 if sum(read_ns) else math.nan,
            f"{len(raw)} batches of {batch_size}",
        )
    ]
    if decode is None:
        decoded, dec_ns = raw, [0] * len(raw)
        results.append(StageResult("decode", "worker", math.inf, note="no decode/transform"))
    else:
        decoded, dec_ns = _timed(lambda r: [decode(s) for s in r], raw)
        name = getattr(decode, "__name__", "transform")
        results.append(StageResult("decode", "worker", _rate(n_samples, sum(dec_ns)), note=name))
    batches, col_ns = _timed(collate, decoded)
    name = getattr(collate, "__name__", "collate")
    results.append(StageResult("collate", "worker", _rate(n_samples, sum(col_ns)), note=name))
    # The first batch pays for opening shards and building the order: not jitter.
    worker_ms = (np.asarray(read_ns) + np.asarray(dec_ns) + np.asarray(col_ns))[1:] / 1e6
    nbytes = _payload_bytes(batches[0])
    results.append(
        _measure_transport(batches[0], batch_size, nbytes, budget)
        if transport
        else StageResult("transport", "main", math.nan, note="not run")
    )
    results.extend(_measure_device(batches, batch_size, device))
    return results, worker_ms


def _measure_transport(batch: Any, batch_size: int, nbytes: int, budget_ns: int) -> StageResult:
    # One worker sends the same collated batch over and over: what the main process pays
    # to receive a batch (unpickling, shared-memory mapping) without any worker work.
    n, prefetch = 256, 4
    ring = transport_available()
    fds = worker_fds(1) if ring else []
    slots = prefetch + 2 if ring else 0  # as StatefulLoader sizes it for one worker
    loader = DataLoader(
        _Repeat(batch, n, slots, fds), batch_size=None, num_workers=1, prefetch_factor=prefetch
    )
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
    # small tensor-free batches take the pipe after the first (see unbroken.data.stream.transport)
    how = "shared-memory ring" if tickets else "torch's pipe"
    return StageResult(
        "transport",
        "main",
        _rate(got * batch_size, ns),
        nbytes * got / (ns / 1e9) / 1e6 if got and ns > 0 else math.nan,
        f"1 worker, {how}, collated batch, fresh copy each",
    )


def _measure_device(batches: list[Any], batch_size: int, device: str | None) -> list[StageResult]:
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        why = "no CUDA device" if dev is None or dev.type == "cuda" else f"device {dev}"
        return [
            StageResult("pin", "main", math.nan, note=why),
            StageResult("h2d", "device", math.nan, note=why),
        ]
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
        StageResult(
            "pin",
            "main",
            _rate(samples, pin_ns),
            nbytes / (pin_ns / 1e9) / 1e6,
            "pin_memory() of collated batches",
        ),
        StageResult(
            "h2d",
            "device",
            samples / h2d_s if h2d_s > 0 else math.inf,
            nbytes / h2d_s / 1e6 if h2d_s > 0 else math.nan,
            f"pinned, non_blocking, {dev}",
        ),
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


def measure_network(ds: Any, samples: int, max_seconds: float) -> tuple[StageResult, Any]:
    """Download, through ``ds``'s cache, the shards holding the first ``samples`` samples in
    manifest order, and more (at least two per download thread) until ``max_seconds``.

    Returns the ``network`` stage (samples/s and MB/s of the parallel downloads) and the
    prefetch hint for :func:`~unbroken.data.diagnose.bottleneck.analyse`: (seconds one shard takes,
    samples per shard, shards per shuffle window).
    """
    from unbroken.data.stream.remote import read_events

    cache = ds.cache
    counts = ds.order.counts[0]
    need = int(np.searchsorted(np.cumsum(counts), samples, side="left")) + 1
    threads = cache.config.threads
    total = len(counts)
    want = min(total, max(need, 2 * threads))
    t0 = time.perf_counter()
    done = 0
    # all the shards the timed batches read, at least two rounds of parallel downloads, more
    # while the time budget lasts (a better estimate of the rate)
    while done < total and (done < want or time.perf_counter() - t0 < max_seconds):
        batch = list(range(done, min(total, done + threads)))
        cache.fetch(batch, prio=0)
        done = batch[-1] + 1
    secs = time.perf_counter() - t0
    nbytes = int(cache.unit_bytes[:done].sum())
    n = int(counts[:done].sum())
    per_unit = [e["secs"] for e in read_events(cache.cache_dir) if e["ev"] == "download"]
    unit_s = float(np.mean(per_unit)) if per_unit else secs / max(done, 1)
    stage = StageResult(
        "network",
        "remote",
        _rate(n, int(secs * 1e9)),
        nbytes / secs / 1e6 if secs > 0 else math.nan,
        f"{done} shards, {threads} parallel downloads, {unit_s:.2f} s per shard",
    )
    window = cache.window_units(0)
    return stage, (unit_s, n / max(done, 1), window)


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
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> BottleneckReport:
    """Measure every stage on a packed dataset (tar or token shards) and analyse.

    Local directory: shard read is :meth:`StreamingDataset.read` on the shuffled epoch-0
    order (the real window-local read path), without its transform; ``transform`` is then
    timed alone. Remote URL: the ``network`` stage first (:func:`measure_network`, into a
    scratch cache under ``cache_dir``, removed afterwards), then the other stages on the
    downloaded shards in manifest order.
    """
    import shutil
    import tempfile

    from unbroken.common.fs import is_remote

    scratch = None
    if is_remote(root):
        if cache_dir is not None:
            os.makedirs(cache_dir, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix="unbroken-bench-cache-", dir=cache_dir)
    try:
        return _bench(
            root,
            batch_size,
            num_workers,
            consume_rate,
            transform,
            collate,
            seq_len,
            device,
            num_batches,
            max_seconds,
            seed,
            scratch,
            storage_options if scratch is not None else None,
        )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _bench(
    root: str,
    batch_size: int,
    num_workers: int,
    consume_rate: float | None,
    transform: Callable[[Any], Any] | None,
    collate: Callable[[list[Any]], Any] | None,
    seq_len: int | None,
    device: str | None,
    num_batches: int,
    max_seconds: float,
    seed: int,
    cache_dir: str | None,
    storage_options: dict[str, Any] | None,
) -> BottleneckReport:
    from unbroken.data.stream.config import CacheConfig
    from unbroken.data.stream.dataset import StreamingDataset

    remote = cache_dir is not None
    # the bench downloads in this process: there is no decoding worker to get in its way
    cache = CacheConfig(
        cache_dir=cache_dir,
        storage_options=storage_options,
        fetch_process=False,
        prefetch_shards=0,
    )
    ds = StreamingDataset(
        root,
        seed=seed,
        seq_len=seq_len,
        rank=0,
        world_size=1,
        shuffle=not remote,
        cache=cache if remote else CacheConfig(),
    )
    part = ds.partition(0, batch_size, "drop")
    total = part.num_batches()
    if total < 2:
        raise ValueError(
            f"{root}: {ds.epoch_length} samples make {total} batch(es) of {batch_size}; the "
            "bench needs at least 2 - pass a smaller --batch-size"
        )
    nb = min(num_batches, total)
    pre: list[StageResult] = []
    hint = None
    if remote:
        net, hint = measure_network(ds, nb * batch_size, max_seconds / 6)
        pre.append(net)
    stages, worker_ms = measure_stages(
        lambda b: ds.read(0, part.batch_positions(b)),
        batch_size=batch_size,
        num_batches=nb,
        decode=transform,
        collate=collate,
        device=device,
        max_seconds=max_seconds,
    )
    return analyse(
        pre + stages,
        batch_size=batch_size,
        num_workers=num_workers,
        consume_rate=consume_rate,
        worker_batch_ms=worker_ms,
        prefetch_hint=hint,
    )


def resolve_transform(spec: str | None) -> Callable[[Any], Any] | None:
    """``"basic"`` -> :func:`basic_decode`, ``"none"``/None -> no transform,
    ``"pkg.module:function"`` -> that function (imported), ``"path/to/train.py:fn"`` -> a
    function defined in a script (imported as module ``train``, its directory put on
    ``sys.path`` so DataLoader workers can unpickle it; its ``__main__`` block does not run).
    """
    if spec is None or spec == "none":
        return None
    if spec == "basic":
        return basic_decode
    mod, sep, name = spec.rpartition(":")
    if not sep or not mod or not name:
        raise ValueError(
            f"--transform {spec!r}: expected 'basic', 'none', "
            "'package.module:function' or 'path/to/script.py:function'"
        )
    import importlib

    try:
        module = _script_module(mod) if mod.endswith(".py") else importlib.import_module(mod)
        fn = getattr(module, name)
    except Exception as e:  # an import error, or the script's own top-level code failing
        raise ValueError(f"--transform {spec!r}: cannot import it ({e})") from e
    if not callable(fn):
        raise ValueError(f"--transform {spec!r} is not callable")
    return fn


def _script_module(path: str) -> Any:
    import importlib.util
    import sys

    if not os.path.isfile(path):
        raise ImportError(f"no file {path!r}")
    path = os.path.abspath(path)
    name = os.path.splitext(os.path.basename(path))[0]
    have = sys.modules.get(name)
    if have is not None:
        if os.path.abspath(getattr(have, "__file__", "") or "") == path:
            return have
        raise ImportError(
            f"a module named {name!r} is already imported from "
            f"{getattr(have, '__file__', 'elsewhere')}; rename the script"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path!r} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # workers unpickle the function by module name
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        sys.path.remove(os.path.dirname(path))
        raise
    return module


def consume_rate_from_timeline(path: str, batch_size: int | None) -> float:
    """samples/s the model ate in a recorded run: batch size / median compute time of a step."""
    from unbroken.data.diagnose.timer import load_timeline

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
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
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
        num_workers=max(1, usable_cpus() - 1) if num_workers is None else num_workers,
        consume_rate=consume_rate,
        transform=resolve_transform(transform),
        seq_len=seq_len,
        device=device,
        num_batches=num_batches,
        max_seconds=max_seconds,
        seed=seed,
        cache_dir=cache_dir,
        storage_options=storage_options,
    )
    path = None
    if out is not None:
        from unbroken.common.fs import atomic_write_bytes

        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, BENCH_FILE)
        atomic_write_bytes(path, json.dumps(report.to_json(), indent=1).encode())
    if metrics is not None:
        from unbroken.common.metrics import MetricLog

        mlog = MetricLog(metrics)
        try:
            mlog.log(metrics_step, **report.metrics())
        finally:
            mlog.close()
    return report, path
