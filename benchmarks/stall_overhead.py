"""Cost of leaving stall accounting on: StepTimer (+ DevicePrefetcher pass-through) vs a bare loop.

Two measurements, in one run:
  1. per-step cost of the instrumentation itself: an empty loop body, 200k steps, bare vs
     ``timer.wrap(...)`` vs ``timer.wrap(DevicePrefetcher(...))`` (CPU pass-through);
  2. a small training step (MLP forward/backward/SGD on CPU, one thread, ~1 ms), bare vs
     instrumented in alternating 20-step chunks, median ratio of the pairs (the machine's
     load changes slower than a pair, so the pair ratio cancels most of it).

Usage: .venv/bin/python benchmarks/stall_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch

from unbroken.data.diagnose.timer import StepTimer
from unbroken.data.feed.prefetch import DevicePrefetcher


def empty_loop(n: int) -> dict[str, float]:
    data = list(range(n))
    out = {}
    for name in ("bare", "StepTimer", "StepTimer+DevicePrefetcher"):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            if name == "bare":
                for _ in data:
                    pass
            elif name == "StepTimer":
                for _ in StepTimer(log_every=100).wrap(data):
                    pass
            else:
                for _ in StepTimer(log_every=100).wrap(DevicePrefetcher(data)):
                    pass
            best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
        out[name] = best
    return out


def training(pairs: int, chunk: int, control: bool = False) -> tuple[float, float, float]:
    """Bare and instrumented chunks of ``chunk`` steps, alternating, so both see the same
    machine load; returns (median bare us/step, median timed us/step, median pair ratio).
    ``control``: the "instrumented" chunk is bare too (A/A: the method's own bias/noise)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [torch.randn(64, 256) for _ in range(chunk)]

    def step(x: torch.Tensor) -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for x in batches * 5:
        step(x)
    timer = StepTimer(log_every=100)
    bare, timed, ratios = [], [], []
    for i in range(pairs):
        order = ("bare", "timed") if i % 2 == 0 else ("timed", "bare")
        res = {}
        for kind in order:
            t0 = time.perf_counter_ns()
            if kind == "bare" or control:
                for x in batches:
                    step(x)
            else:
                for x in timer.wrap(DevicePrefetcher(batches)):
                    step(x)
            res[kind] = (time.perf_counter_ns() - t0) / chunk / 1e3
        bare.append(res["bare"])
        timed.append(res["timed"])
        ratios.append(res["timed"] / res["bare"])
    return statistics.median(bare), statistics.median(timed), statistics.median(ratios)


def main() -> None:
    e = empty_loop(200_000)
    print("1. instrumentation alone (empty loop body, best of 5, us/step)")
    for k, v in e.items():
        extra = "" if k == "bare" else f"   +{v - e['bare']:.2f} us/step"
        print(f"   {k:<28} {v:7.3f}{extra}")
    over = e["StepTimer+DevicePrefetcher"] - e["bare"]
    print(f"   -> {100 * over / 1e3:.3f}% of a 1 ms step, {100 * over / 1e4:.4f}% of a 10 ms step")
    b, t, r = training(300, 20)
    print("2. small CPU training step, 300 alternating pairs of 20-step chunks (us/step)")
    print(f"   bare {b:.1f}   StepTimer+DevicePrefetcher {t:.1f}   median pair ratio {r:.4f}")
    b, t, r = training(300, 20, control=True)
    print(f"   A/A control (bare vs bare, same method): median pair ratio {r:.4f}")


if __name__ == "__main__":
    main()
