"""Per-step stall accounting and sawtooth detection: is the loop waiting for data, and why?

``StepTimer`` measures, for every training step, how long the loop waited for its next batch
and how long it computed until it asked for the following one; with a
:class:`~unbroken.data.feed.prefetch.DevicePrefetcher` on CUDA also each batch's H2D copy
time, and with ``network=dataset`` (a remote source) how much of each wait was a download.
``stall % = wait / (wait + compute)`` over a rolling window. Cost: two ``perf_counter_ns``
calls and four numpy stores per step (``benchmarks/RESULTS.md``, checked by a unit test).

It appends the step timeline to ``<run_dir>/data_steps.csv`` once per ``window`` steps and
on ``close()``; ``unbroken data report`` reads it. Wait and compute are host times: they
match the GPU's only when the loop synchronises every step (``loss.item()`` does).

The file format and the host-clock caveat: ARCHITECTURE.md, "Design notes" > data > the
step timer.
"""

from __future__ import annotations

import collections
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "TIMELINE_FILE",
    "Sawtooth",
    "StallSummary",
    "StepTimer",
    "Timeline",
    "detect_sawtooth",
    "load_timeline",
    "summarize",
    "tensorboard_writer",
]

TIMELINE_FILE = "data_steps.csv"
_HEADER = "step,wait_ms,compute_ms,h2d_ms,h2d_bytes,net_ms"
_HEADER_V0 = "step,wait_ms,compute_ms,h2d_ms,h2d_bytes"  # before the network column
_NS_PER_MS = 1_000_000


def _network_probe(network: Any) -> Any:
    if network is None or hasattr(network, "blocked_ns"):
        return network
    from unbroken.data.stream.remote import network_probe

    return network_probe(network)


def tensorboard_writer(log_dir: str) -> Any | None:
    """A TensorBoard ``SummaryWriter`` for ``log_dir``, or None when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir)


@dataclass(frozen=True)
class StallSummary:
    """Averages over a span of steps (times in ms; NaN where not measured)."""

    steps: int
    step_ms: float
    wait_ms: float
    compute_ms: float
    stall_pct: float
    """100 x total wait / total step time."""
    wait_p50_ms: float
    wait_p95_ms: float
    h2d_ms: float
    """Mean H2D copy time per batch (CUDA events), NaN on CPU."""
    h2d_gbps: float
    """Bytes copied / copy time, GB/s (1e9), NaN on CPU."""
    samples_per_s: float
    """batch_size / mean step time; NaN when the batch size is unknown."""
    net_ms: float = float("nan")
    """Mean wait per step spent on downloads of a remote dataset; NaN when not watched."""
    net_pct: float = float("nan")
    """100 x download wait / total step time: the share of the run lost to the network."""

    def metrics(self, prefix: str = "data/") -> dict[str, float]:
        """The finite values, named for a metric log / TensorBoard."""
        vals = {
            "stall_pct": self.stall_pct,
            "step_ms": self.step_ms,
            "wait_ms": self.wait_ms,
            "wait_p95_ms": self.wait_p95_ms,
            "compute_ms": self.compute_ms,
            "h2d_ms": self.h2d_ms,
            "h2d_gbps": self.h2d_gbps,
            "samples_per_s": self.samples_per_s,
            "net_ms": self.net_ms,
            "net_pct": self.net_pct,
        }
        return {prefix + k: round(v, 6) for k, v in vals.items() if math.isfinite(v)}

    def format(self) -> str:
        parts = [
            f"{self.steps} steps",
            f"step {self.step_ms:.2f} ms",
            f"wait {self.wait_ms:.2f} ms (p95 {self.wait_p95_ms:.2f})",
            f"stall {self.stall_pct:.1f}%",
        ]
        if math.isfinite(self.net_ms):
            parts.append(f"network {self.net_ms:.2f} ms ({self.net_pct:.1f}% of the time)")
        if math.isfinite(self.h2d_ms):
            parts.append(f"H2D {self.h2d_ms:.2f} ms ({self.h2d_gbps:.1f} GB/s)")
        if math.isfinite(self.samples_per_s):
            parts.append(f"{self.samples_per_s:,.0f} samples/s")
        return ", ".join(parts)


def summarize(
    wait_ms: np.ndarray,
    compute_ms: np.ndarray,
    h2d_ms: np.ndarray | None = None,
    h2d_bytes: np.ndarray | None = None,
    batch_size: int | None = None,
    net_ms: np.ndarray | None = None,
) -> StallSummary:
    """The stall arithmetic, shared by the live timer and the report on a saved timeline."""
    n = int(wait_ms.size)
    if n == 0:
        nan = float("nan")
        return StallSummary(0, nan, nan, nan, nan, nan, nan, nan, nan, nan)
    wait_total = float(wait_ms.sum())
    step_total = wait_total + float(compute_ms.sum())
    step_mean = step_total / n
    p50, p95 = (float(v) for v in np.percentile(wait_ms, [50, 95]))
    h2d = gbps = float("nan")
    if h2d_ms is not None and h2d_bytes is not None:
        known = np.isfinite(h2d_ms)
        if known.any():
            h2d = float(h2d_ms[known].mean())
            secs = float(h2d_ms[known].sum()) / 1e3
            gbps = float(h2d_bytes[known].sum()) / secs / 1e9 if secs > 0 else float("nan")
    rate = batch_size / (step_mean / 1e3) if batch_size and step_mean > 0 else float("nan")
    net = net_pct = float("nan")
    if net_ms is not None and np.isfinite(net_ms).any():
        known = np.isfinite(net_ms)
        net = float(net_ms[known].mean())
        known_total = float(wait_ms[known].sum() + compute_ms[known].sum())
        net_pct = 100.0 * float(net_ms[known].sum()) / known_total if known_total > 0 else 0.0
    return StallSummary(
        steps=n,
        step_ms=step_mean,
        wait_ms=wait_total / n,
        compute_ms=float(compute_ms.mean()),
        stall_pct=100.0 * wait_total / step_total if step_total > 0 else 0.0,
        wait_p50_ms=p50,
        wait_p95_ms=p95,
        h2d_ms=h2d,
        h2d_gbps=gbps,
        samples_per_s=rate,
        net_ms=net,
        net_pct=net_pct,
    )


class StepTimer:
    """Per-step wait/compute/H2D accounting with a rolling window.

    Use ``wrap`` around the batch iterable (the time spent inside ``next()`` is the wait;
    the time from receiving a batch to asking for the next one is the step's compute)::

        timer = StepTimer(sinks=[metric_log], run_dir="runs/x", batch_size=32)
        for batch in timer.wrap(DevicePrefetcher(loader, device="cuda")):
            train_step(batch)
        timer.close()

    or mark the two instants yourself: ``timer.before_next()``, ``batch = next(it)``,
    ``timer.after_next()`` (a step is recorded at the following ``before_next()``, or at
    ``close()``). Leaving the loop with ``break`` (or an exception) records the step that
    was running, its compute ending at that moment.

    Args:
        window: steps kept in the ring buffers that ``summary()`` averages over.
        sinks: objects with ``log(step, **values)`` (``unbroken.common.metrics.MetricLog``) or
            ``add_scalar(tag, value, step)`` (TensorBoard ``SummaryWriter``).
        log_every: steps between two summaries sent to the sinks (0: never).
        run_dir: where to append the step timeline (``data_steps.csv``); None keeps none.
        batch_size: samples per batch, for samples/s (optional).
        num_workers: recorded in the timeline header so the report can relate a sawtooth
            period to it (optional).
        start_step: steps already done before this timer (0 for a new run; the restored
            step after a restart). Steps are numbered like the training loop's
            ``state.step += 1; metrics.log(state.step, ...)``: the first step this timer
            records is ``start_step + 1``, so its summaries and timeline line up with the
            metric log.
        network: the ``StreamingDataset`` this rank reads, when it reads a remote source (or
            a :class:`~unbroken.data.stream.remote.NetworkWaitProbe`): each step's wait is split
            into the part the rank's readers spent blocked on downloads (``net_ms``) and the
            rest. Ignored for local data.
    """

    def __init__(
        self,
        window: int = 1000,
        *,
        sinks: Sequence[Any] = (),
        log_every: int = 100,
        run_dir: str | None = None,
        batch_size: int | None = None,
        num_workers: int | None = None,
        start_step: int = 0,
        prefix: str = "data/",
        network: Any = None,
    ) -> None:
        if window < 2:
            raise ValueError(f"StepTimer: window={window} must be >= 2 steps; pass window=1000")
        if log_every < 0:
            raise ValueError(f"StepTimer: log_every={log_every} must be >= 0 (0 = never)")
        for s in sinks:
            if not (hasattr(s, "log") or hasattr(s, "add_scalar")):
                raise ValueError(
                    f"StepTimer: sink {s!r} has neither log(step, **values) nor "
                    "add_scalar(tag, value, step); pass a MetricLog or a SummaryWriter"
                )
        self.window = window
        self._sinks = list(sinks)
        self._log_every = log_every
        self._run_dir = run_dir
        self.batch_size = batch_size
        self.num_workers = num_workers
        self._start_step = start_step
        self._prefix = prefix
        self._wait = np.zeros(window, np.int64)
        self._compute = np.zeros(window, np.int64)
        self._h2d = np.full(window, -1, np.int64)  # ns; -1 = unknown
        self._bytes = np.zeros(window, np.int64)
        self._net = np.full(window, -1, np.int64)  # ns; -1 = not watched
        self._probe = _network_probe(network)
        self._net0: np.ndarray | None = None  # readers' blocked ns when the wait began
        self._net_ns = -1  # the open step's network wait
        self._n = 0  # steps recorded
        self._flushed = 0  # steps already appended to the timeline file
        self._t_req = -1  # when the loop asked for the pending batch
        self._t_got = -1  # when it received it (-1: no step open)
        self._pending: collections.deque[tuple[int, int, Any, Any]] = collections.deque()
        self.last_summary: StallSummary | None = None

    # -- recording -----------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Steps recorded so far (by this timer, not counting ``start_step``)."""
        return self._n

    def before_next(self) -> None:
        """The loop is about to ask for a batch: closes the previous step."""
        t = time.perf_counter_ns()
        if self._t_got >= 0:
            self._record(self._t_got - self._t_req, t - self._t_got)
        self._t_req = t
        self._t_got = -1
        if self._probe is not None:
            self._net0 = self._probe.blocked_ns()

    def after_next(self) -> None:
        """The loop has its batch: the wait is over, the step's compute begins."""
        self._t_got = time.perf_counter_ns()
        if self._probe is not None:
            self._net_done()

    def _net_done(self) -> None:
        # The readers that were blocked while the loop waited: the most any one of them was
        # blocked is how long the network held this batch up (capped at the wait itself).
        if self._probe is None or self._net0 is None:
            return
        grew = self._probe.blocked_ns() - self._net0
        self._net_ns = min(int(grew.max()) if grew.size else 0, self._t_got - self._t_req)

    def close_step(self) -> None:
        """Record the open step now (its compute ends now); used at the end of a loop."""
        if self._t_got >= 0:
            self._record(self._t_got - self._t_req, time.perf_counter_ns() - self._t_got)
            self._t_got = -1

    def wrap(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``iterable`` while timing each step.

        If ``iterable`` has ``observe_copies`` (a ``DevicePrefetcher``), its H2D copy events
        are accounted too. Leaving the loop early (``break``, an exception) records the step
        in progress, its compute ending then (the generator is closed as the loop drops it;
        ``close()`` records it too when a reference to the generator outlives the loop).
        """
        observe = getattr(iterable, "observe_copies", None)
        if observe is not None:
            observe(self.note_copy)
        it = iter(iterable)
        try:
            while True:
                self.before_next()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self._t_got = time.perf_counter_ns()
                if self._probe is not None:
                    self._net_done()
                yield batch
        finally:
            self.close_step()
            if observe is not None:
                observe(None)

    def note_copy(self, nbytes: int, start: Any, end: Any) -> None:
        """A batch for the step being requested was copied between CUDA events."""
        if start is not None and end is not None:
            self._pending.append((self._n, nbytes, start, end))

    def _record(self, wait_ns: int, compute_ns: int) -> None:
        slot = self._n % self.window
        self._wait[slot] = wait_ns
        self._compute[slot] = compute_ns
        self._h2d[slot] = -1
        self._bytes[slot] = 0
        self._net[slot] = self._net_ns
        self._net_ns = -1
        self._n += 1
        if self._pending:
            self._resolve_copies(block=False)
        if self._log_every and self._n % self._log_every == 0:
            self.emit()
        if self._run_dir is not None and self._n - self._flushed >= self.window:
            self.flush()

    def _resolve_copies(self, block: bool) -> None:
        # Copies finish asynchronously; fill their slots once the end event has completed.
        while self._pending:
            step, nbytes, start, end = self._pending[0]
            if step >= self._n:
                return  # that step is still open; its slot would be reset on record
            if not block and not end.query():
                return
            self._pending.popleft()
            if block:
                end.synchronize()
            if step >= self._n - self.window:
                slot = step % self.window
                self._h2d[slot] = int(start.elapsed_time(end) * _NS_PER_MS)
                self._bytes[slot] = nbytes

    # -- reading -------------------------------------------------------------------------

    def _ordered(self, last: int) -> tuple[np.ndarray, ...]:
        """The last ``last`` recorded steps, oldest first, as ms (h2d NaN where unknown)."""
        last = min(last, self._n, self.window)
        idx = np.arange(self._n - last, self._n) % self.window
        h2d = self._h2d[idx].astype(np.float64)
        h2d[h2d < 0] = np.nan
        net = self._net[idx].astype(np.float64)
        net[net < 0] = np.nan
        return (
            self._wait[idx] / _NS_PER_MS,
            self._compute[idx] / _NS_PER_MS,
            h2d / _NS_PER_MS,
            self._bytes[idx].copy(),
            net / _NS_PER_MS,
        )

    def summary(self, last: int | None = None) -> StallSummary:
        """Averages over the last ``last`` steps (default: the whole window)."""
        wait, comp, h2d, nbytes, net = self._ordered(self.window if last is None else last)
        return summarize(wait, comp, h2d, nbytes, self.batch_size, net)

    def emit(self) -> StallSummary:
        """Send a summary of the last ``log_every`` steps to the sinks."""
        s = self.summary(self._log_every or None)
        self.last_summary = s
        step = self._start_step + self._n
        values = s.metrics(self._prefix)
        for sink in self._sinks:
            if hasattr(sink, "log"):
                sink.log(step, **values)
            else:
                for k, v in values.items():
                    sink.add_scalar(k, v, step)
        return s

    def flush(self) -> str | None:
        """Append the steps not yet written to ``<run_dir>/data_steps.csv``; returns the path."""
        if self._run_dir is None:
            return None
        if self._pending:
            self._resolve_copies(block=True)
        todo = self._n - self._flushed
        path = os.path.join(self._run_dir, TIMELINE_FILE)
        if todo <= 0:
            return path
        lost = max(0, todo - self.window)  # only possible if flush() was never reached
        wait, comp, h2d, nbytes, net = self._ordered(todo - lost)
        first = self._start_step + self._flushed + lost + 1
        os.makedirs(self._run_dir, exist_ok=True)
        new = not os.path.exists(path)
        lines = []
        if new:
            lines.append(
                f"# unbroken step timeline v1 batch_size={self.batch_size or ''} "
                f"num_workers={'' if self.num_workers is None else self.num_workers}\n"
            )
            lines.append(_HEADER + "\n")
        for i in range(wait.size):
            h = "" if math.isnan(h2d[i]) else f"{h2d[i]:.4f}"
            n = "" if math.isnan(net[i]) else f"{net[i]:.4f}"
            lines.append(f"{first + i},{wait[i]:.4f},{comp[i]:.4f},{h},{int(nbytes[i])},{n}\n")
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(lines)
        self._flushed = self._n
        return path

    def close(self) -> StallSummary:
        """Record the open step, write the rest of the timeline; returns the window summary."""
        self.close_step()
        self.flush()
        return self.summary()


# -- saved timelines ---------------------------------------------------------------------


@dataclass(frozen=True)
class Timeline:
    """A step timeline read back from ``data_steps.csv`` (times in ms)."""

    step: np.ndarray
    wait_ms: np.ndarray
    compute_ms: np.ndarray
    h2d_ms: np.ndarray
    h2d_bytes: np.ndarray
    batch_size: int | None = None
    num_workers: int | None = None
    net_ms: np.ndarray | None = None
    """Download wait per step (NaN where not watched); None for a file without the column."""

    def summary(self) -> StallSummary:
        return summarize(
            self.wait_ms, self.compute_ms, self.h2d_ms, self.h2d_bytes, self.batch_size, self.net_ms
        )


def _header_field(line: str, name: str) -> int | None:
    for tok in line.split():
        if tok.startswith(name + "="):
            val = tok.split("=", 1)[1]
            return int(val) if val.isdigit() else None
    return None


def load_timeline(path: str) -> Timeline:
    """Read a timeline written by :class:`StepTimer` (a file or the run directory)."""
    if os.path.isdir(path):
        path = os.path.join(path, TIMELINE_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path}: no step timeline; run the training loop under "
            "StepTimer(run_dir=...) and call timer.close() at the end"
        )
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    meta = lines[0] if lines and lines[0].startswith("#") else ""
    body = [ln for ln in lines if ln and not ln.startswith("#")]
    if not body or body[0].strip() not in (_HEADER, _HEADER_V0):
        raise ValueError(f"{path}: first row is not {_HEADER!r}; is this a data_steps.csv?")
    width = body[0].count(",") + 1
    cols: list[list[float]] = [[] for _ in range(width)]
    for k, ln in enumerate(body[1:], start=2):
        fields = ln.split(",")
        if len(fields) != width:
            # A torn last line from a crash mid-append is skipped; anything else is damage.
            if k == len(body):
                break
            raise ValueError(f"{path}: row {k} {ln!r} has {len(fields)} fields, expected {width}")
        try:
            vals = [float(v) if v else math.nan for v in fields]
        except ValueError as e:
            raise ValueError(f"{path}: row {k} {ln!r}: {e}") from e
        vals[4] = 0.0 if math.isnan(vals[4]) else vals[4]
        for c, v in zip(cols, vals, strict=True):
            c.append(v)
    return Timeline(
        step=np.asarray(cols[0], dtype=np.int64),
        wait_ms=np.asarray(cols[1]),
        compute_ms=np.asarray(cols[2]),
        h2d_ms=np.asarray(cols[3]),
        h2d_bytes=np.asarray(cols[4], dtype=np.int64),
        batch_size=_header_field(meta, "batch_size"),
        num_workers=_header_field(meta, "num_workers"),
        net_ms=np.asarray(cols[5]) if width > 5 else None,
    )


# -- sawtooth ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sawtooth:
    """Periodic long waits in a step timeline."""

    period: int
    """Steps in one cycle of the pattern (the lag of the wait series' autocorrelation peak)."""
    occurrences: int
    """Long waits in the timeline."""
    long_wait_ms: float
    """Mean length of a long wait."""
    wait_per_cycle_ms: float
    """All waiting per cycle of ``period`` steps."""
    share_of_wait: float
    """Fraction of all waiting spent in the long waits."""
    strength: float
    """Autocorrelation of the wait series at ``period`` (1 = perfectly periodic)."""
    compute_ms: float
    """Median compute time of a step."""

    def explain(self, num_workers: int | None = None) -> str:
        # One cycle = the time a worker needs for one batch: `period` steps of compute plus
        # the waiting in between.
        cycle = self.period * self.compute_ms + self.wait_per_cycle_ms
        need = math.ceil(cycle / self.compute_ms) if self.compute_ms > 0 else None
        lines = [
            f"sawtooth: a cycle of {self.period} steps with {self.wait_per_cycle_ms:.1f} ms of "
            f"waiting (long waits of {self.long_wait_ms:.1f} ms, {self.occurrences} of them, "
            f"{100 * self.share_of_wait:.0f}% of all waiting); every {self.period} steps the "
            "loop waits.",
            "Meaning: the DataLoader workers finish their batches at about the same time, "
            "the loop eats that burst, then waits until the workers' next batches are ready. "
            f"A worker needs about {cycle:.0f} ms per batch while the loop consumes a batch "
            f"every {self.compute_ms:.1f} ms, so the workers are too slow on average.",
        ]
        if num_workers is not None:
            match = (
                "matches"
                if abs(self.period - num_workers) <= max(1, num_workers // 5)
                else "does not match"
            )
            lines.append(f"The period {match} num_workers={num_workers}.")
        fix = "Fix: raise num_workers"
        if need is not None:
            fix += f" to about {need} (worker batch time / step compute time)"
        fix += (
            " or make per-sample work cheaper (decode once, move augmentation to the GPU). "
            "A larger prefetch_factor only delays the first wait: it buffers batches, "
            "it does not produce them faster."
        )
        lines.append(fix)
        return "\n".join(lines)


def detect_sawtooth(
    wait_ms: np.ndarray,
    compute_ms: np.ndarray,
    *,
    min_cycles: int = 4,
    min_strength: float = 0.4,
    max_period: int = 64,
) -> Sawtooth | None:
    """Find periodic long waits (every ~``num_workers`` steps) in a step timeline.

    The period is the smallest lag >= 2 at which the autocorrelation of the wait series has a
    local peak of at least ``min_strength`` and within 85% of the highest one (so a harmonic
    2P is not taken for P, and a cycle with two long waits, e.g. ``[23, 12, 0, 0]``, has
    period 4, not 2). Long waits exceed both 4x the quick waits (25th percentile) and the
    quick waits plus 20% of a median step. A uniformly starved loop (every step waits alike) or random spikes
    (stragglers, GC pauses) are not a sawtooth. The first step (worker start-up) is ignored.
    """
    wait = np.asarray(wait_ms, dtype=np.float64)[1:]
    comp = np.asarray(compute_ms, dtype=np.float64)[1:]
    n = int(wait.size)
    lags = min(max_period, n // min_cycles)
    if lags < 2:
        return None
    # Baseline: the quick waits. The 25th percentile, not the median, so that a cycle where
    # most steps wait (e.g. [10, 14, 11, 0.2]) still shows its teeth.
    base = float(np.percentile(wait, 25))
    med_comp = float(np.median(comp))
    threshold = max(4.0 * base, base + 0.2 * (base + med_comp), 1e-6)
    long = wait > threshold
    if int(long.sum()) < min_cycles:
        return None
    # Start-up and straggler waits (many times a normal tooth) would dominate the
    # autocorrelation; clip them to twice the typical long wait.
    clipped = np.minimum(wait, 2.0 * float(np.median(wait[long])))
    x = clipped - clipped.mean()
    energy = float(x @ x)
    if energy <= 0.0:
        return None
    # Biased estimator (sum over the overlap / total energy): harmonics come out smaller.
    acf = np.array([float(x[:-k] @ x[k:]) / energy for k in range(1, lags + 2)])
    best = float(acf[1:lags].max())  # lags 2..lags
    period = 0
    for k in range(2, lags + 1):
        a = acf[k - 1]
        if a >= min_strength and a >= 0.85 * best and a > acf[k - 2] and a >= acf[k]:
            period = k
            break
    if period == 0:
        return None
    total = float(wait.sum())
    return Sawtooth(
        period=period,
        occurrences=int(long.sum()),
        long_wait_ms=float(wait[long].mean()),
        wait_per_cycle_ms=total * period / n,
        share_of_wait=float(wait[long].sum()) / total,
        strength=float(acf[period - 1]),
        compute_ms=med_comp,
    )
