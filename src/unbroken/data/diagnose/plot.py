"""`unbroken data report RUN_DIR`: text summary and a PNG of the step timeline and stages.

Reads what a run left in ``RUN_DIR``: the step timeline ``data_steps.csv``
(:class:`~unbroken.data.diagnose.timer.StepTimer`) and/or the stage measurements
``data_bench.json`` (``unbroken data bench --out RUN_DIR``). The PNG
(``RUN_DIR/data_report.png`` by default) has up to three panels: the whole timeline (compute
and wait stacked, binned when long), the last steps as stacked bars (a sawtooth shows up
here), and each stage's throughput next to the consumer's rate. matplotlib is the optional
``plot`` extra; it is imported only here.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from unbroken.data.diagnose.bottleneck import BENCH_FILE, BottleneckReport, load_report
from unbroken.data.diagnose.timer import (
    TIMELINE_FILE,
    Sawtooth,
    Timeline,
    detect_sawtooth,
    load_timeline,
)

__all__ = ["REPORT_FILE", "plot_report", "report_text", "run_report"]

REPORT_FILE = "data_report.png"
_MAX_POINTS = 2000  # timeline points drawn; longer runs are averaged into bins
_ZOOM = 120  # steps shown as bars in the zoom panel
_COMPUTE, _WAIT, _H2D = "#4C72B0", "#DD5555", "#55A868"


def report_text(
    timeline: Timeline | None,
    bench: BottleneckReport | None,
    sawtooth: Sawtooth | None,
    num_workers: int | None = None,
) -> str:
    """What the CLI prints: the stall summary, the sawtooth verdict and the bench table."""
    out: list[str] = []
    if timeline is not None:
        s = timeline.summary()
        out.append(f"step timeline: {s.format()}")
        if sawtooth is not None:
            out.append(sawtooth.explain(num_workers))
        elif s.stall_pct >= 5.0:
            out.append(
                "no sawtooth: the waits are spread over the steps (the loader is "
                "uniformly too slow, or stalls at random); see `unbroken data bench`"
            )
        else:
            out.append("no sawtooth; stall below 5%: the input pipeline keeps up")
    if bench is not None:
        if out:
            out.append("")
        out.append(bench.format())
    return "\n".join(out)


def _binned(x: np.ndarray, k: int) -> np.ndarray:
    n = x.size // k * k
    return x[:n].reshape(-1, k).mean(axis=1)


def plot_report(
    timeline: Timeline | None,
    bench: BottleneckReport | None,
    out: str,
    sawtooth: Sawtooth | None = None,
) -> str:
    """Write the PNG to ``out``; returns ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(
            "the data report plot needs matplotlib: pip install 'unbroken[plot]'"
        ) from e
    panels = (2 if timeline is not None else 0) + (1 if bench is not None else 0)
    if panels == 0:
        raise ValueError("nothing to plot: need a step timeline and/or a bench report")
    fig, axes = plt.subplots(panels, 1, figsize=(11, 3.3 * panels), squeeze=False)
    ax_iter = iter(axes[:, 0])
    if timeline is not None:
        _plot_timeline(next(ax_iter), timeline, sawtooth)
        _plot_zoom(next(ax_iter), timeline)
    if bench is not None:
        _plot_stages(next(ax_iter), bench)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_timeline(ax: Any, tl: Timeline, sawtooth: Sawtooth | None) -> None:
    steps, wait, comp = tl.step.astype(np.float64), tl.wait_ms, tl.compute_ms
    k = max(1, math.ceil(steps.size / _MAX_POINTS))
    if k > 1:
        steps, wait, comp = _binned(steps, k), _binned(wait, k), _binned(comp, k)
    ax.fill_between(steps, 0, comp, step="mid", color=_COMPUTE, alpha=0.85, label="compute")
    ax.fill_between(
        steps, comp, comp + wait, step="mid", color=_WAIT, alpha=0.85, label="wait for data"
    )
    s = tl.summary()
    title = f"step time: compute vs wait  (stall {s.stall_pct:.1f}%, mean step {s.step_ms:.1f} ms"
    title += f", mean of {k} steps per point)" if k > 1 else ")"
    if sawtooth is not None:
        title += f"  sawtooth: period {sawtooth.period} steps"
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    # Start-up waits are often 10-100x a step; do not let them flatten the plot.
    top = float(np.percentile(comp + wait, 99.5)) * 1.35  # headroom for the legend
    if top > 0:
        ax.set_ylim(0, top)
    ax.set_xlim(steps[0], steps[-1] if steps.size > 1 else steps[0] + 1)
    ax.legend(loc="upper left", ncol=2, fontsize=8, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)


def _plot_zoom(ax: Any, tl: Timeline) -> None:
    n = min(_ZOOM, tl.step.size)
    steps, wait, comp = tl.step[-n:], tl.wait_ms[-n:], tl.compute_ms[-n:]
    ax.bar(steps, comp, width=0.85, color=_COMPUTE, label="compute")
    ax.bar(steps, wait, width=0.85, bottom=comp, color=_WAIT, label="wait for data")
    h2d = tl.h2d_ms[-n:]
    if np.isfinite(h2d).any():
        ax.plot(steps, h2d, color=_H2D, marker=".", lw=1, label="H2D copy (side stream)")
    ax.set_title(f"last {n} steps", fontsize=10, loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_ylim(0, float(np.max(comp + wait)) * 1.3)
    ax.legend(loc="upper left", ncol=3, fontsize=8, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)


def _plot_stages(ax: Any, r: BottleneckReport) -> None:
    nw = max(1, min(r.num_workers, r.cpu_count))
    names, rates, colors = [], [], []
    for s in r.stages:
        if not math.isfinite(s.samples_per_s):
            continue  # skipped (nan) or a no-op stage (inf)
        scale = nw if s.where == "worker" else 1
        names.append(f"{s.name}" + (f" (x{nw} workers)" if scale > 1 else ""))
        rates.append(s.samples_per_s * scale)
        limit_color = _WAIT if r.bottleneck != "no data stall" else "#E89B3C"
        colors.append(limit_color if s.name == r.limiting else _COMPUTE)
    if not rates:
        ax.text(0.5, 0.5, "no stage measured", ha="center", transform=ax.transAxes)
        return
    y = np.arange(len(rates))[::-1]
    ax.barh(y, rates, color=colors)
    ax.set_yticks(y, names, fontsize=9)
    ax.set_xscale("log")
    for yi, v in zip(y, rates, strict=True):
        ax.text(v, yi, f" {v:,.0f}", va="center", fontsize=8)
    ax.axvline(
        r.pipeline_rate, color="black", ls=":", lw=1.2, label=f"pipeline {r.pipeline_rate:,.0f}/s"
    )
    if r.consume_rate is not None:
        ax.axvline(
            r.consume_rate, color=_H2D, ls="--", lw=1.5, label=f"consumer {r.consume_rate:,.0f}/s"
        )
    ax.set_xlim(
        min(rates + [r.consume_rate or rates[0]]) / 3, max(rates + [r.consume_rate or rates[0]]) * 8
    )
    ax.set_xlabel("samples/s (log scale; worker stages times the workers used)")
    ax.set_title(
        f"stage throughput, each stage alone; bottleneck: {r.bottleneck}", fontsize=10, loc="left"
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3, which="both")


def run_report(
    run_dir: str,
    *,
    out: str | None = None,
    num_workers: int | None = None,
    plot: bool = True,
) -> tuple[str, str | None]:
    """Load what ``run_dir`` holds, analyse it; returns (text, PNG path or None)."""
    has_tl = os.path.exists(os.path.join(run_dir, TIMELINE_FILE))
    has_bench = os.path.exists(os.path.join(run_dir, BENCH_FILE))
    if not (has_tl or has_bench):
        raise FileNotFoundError(
            f"{run_dir}: holds neither {TIMELINE_FILE} (run the loop under "
            f"StepTimer(run_dir=...)) nor {BENCH_FILE} (run `unbroken data bench DIR --out "
            f"{run_dir}`)"
        )
    tl = load_timeline(run_dir) if has_tl else None
    bench = load_report(run_dir) if has_bench else None
    saw = detect_sawtooth(tl.wait_ms, tl.compute_ms) if tl is not None else None
    workers = num_workers if num_workers is not None else (tl.num_workers if tl else None)
    text = report_text(tl, bench, saw, workers)
    png = None
    if plot:
        png = plot_report(tl, bench, out or os.path.join(run_dir, REPORT_FILE), saw)
    return text, png
