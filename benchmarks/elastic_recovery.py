"""Recovery after a SIGKILLed worker: `unbroken run` vs the anchor, torchrun's own restart.

Same 2-worker gloo job (tests/integration/scripts/elastic_train.py), same kill point. The
anchor is ``torchrun --standalone --max-restarts 1``, which restarts the worker group inside
the running agent. ``unbroken run`` starts a fresh torchrun per attempt (with pre-flight,
classification and backoff in between). Measured from outside, identically for both, through
the workers' heartbeat files (the anchor run gets UNBROKEN_RUN_DIR set by hand so the same
script writes them):

- regain: SIGKILL -> a restarted worker beats the step reached before the kill (the whole
  recovery: detect + relaunch + load + catch-up);
- first beat: SIGKILL -> a restarted worker's first beat (detect + relaunch + load).

A second anchor row sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as `unbroken run` does for its
agents, to separate the effect of that setting from the effect of a fresh agent per attempt.
Modes run interleaved, so machine load hits all alike; the table shows medians and the
ratio to the anchor.

    .venv/bin/python benchmarks/elastic_recovery.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from unbroken.elastic import heartbeat, recovery
from unbroken.elastic._procs import kill_matching

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "tests", "integration", "scripts", "elastic_train.py")
MODES = {
    "torchrun --max-restarts 1 (anchor)": ["torchrun"],
    "anchor + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": ["torchrun", "noshare"],
    "unbroken run (defaults)": ["unbroken"],
    "unbroken run --poll-interval 0.1 --backoff 0": ["unbroken", "--poll-interval", "0.1",
                                                    "--backoff", "0"],
}


def _beats(run_dir: str) -> list[heartbeat.BeatRecord]:
    out = []
    for d in glob.glob(os.path.join(run_dir, "beats", "a*")):
        out += heartbeat.read_beats(run_dir, int(os.path.basename(d)[1:]))
    return [b for b in out if b.started]


def one(mode: list[str], work: str, kill_at: int) -> tuple[float, float]:
    run_dir = os.path.join(work, "run")
    os.makedirs(run_dir)
    script = [SCRIPT, "--ckpt", os.path.join(work, "ckpt"), "--metrics",
              os.path.join(work, "m.jsonl"), "--steps", "60", "--save-every", "5"]
    env = dict(os.environ)
    if mode[0] == "torchrun":
        env.update({recovery.ENV_RUN_DIR: run_dir, recovery.ENV_ATTEMPT: "0"})
        if "noshare" in mode:  # what `unbroken run` sets for its agents
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", "1", *script]
    else:
        argv = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", run_dir, "-q",
                "--nproc-per-node", "2", *mode[1:], "--", *script]
    log = open(os.path.join(work, "log.txt"), "wb")  # noqa: SIM115 - closed below
    p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        while True:
            bs = _beats(run_dir)
            if len(bs) >= 2 and min(b.step for b in bs) >= kill_at:
                break
            _alive(p, work, "before the kill")
            time.sleep(0.02)
        old = {b.pid for b in bs}
        reached = max(b.step for b in bs)
        victim = max(bs, key=lambda b: b.rank)
        t_kill = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        first = regain = None
        while regain is None:
            new = [b for b in _beats(run_dir) if b.pid not in old]
            if new and first is None:
                first = time.time() - t_kill
            if any(b.step >= reached for b in new):
                regain = time.time() - t_kill
            elif time.time() - t_kill > HUNG_AFTER:
                raise _Failed(f"no progress {HUNG_AFTER:g} s after the kill (hung)", work)
            _alive(p, work, "after the kill")
            time.sleep(0.02)
        if p.wait(180) != 0:
            raise _Failed(f"exited {p.returncode} after recovering", work)
        return first or regain, regain
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        kill_matching(recovery.ENV_RUN_DIR, run_dir, timeout=5)
        log.close()


HUNG_AFTER = 60.0


class _Failed(RuntimeError):
    def __init__(self, what: str, work: str) -> None:
        with open(os.path.join(work, "log.txt"), "rb") as f:
            tail = f.read().decode("utf-8", "replace").splitlines()
        lines = [ln for ln in tail if "Error" in ln or "error" in ln][-3:]
        super().__init__(f"{what}; last errors: {' | '.join(lines)[:600]}")


def _alive(p: subprocess.Popen[bytes], work: str, when: str) -> None:
    if p.poll() is not None:
        raise _Failed(f"job exited {p.returncode} {when}", work)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=15)
    a = ap.parse_args()
    res: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    failed: dict[str, list[str]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for i, (name, mode) in enumerate(MODES.items()):
                try:
                    res[name].append(one(mode, os.path.join(tmp, f"{r}-{i}"), a.kill_at))
                except _Failed as e:
                    failed[name].append(str(e))
                    print(f"repeat {r} {name}: FAILED: {e}", flush=True)
                    continue
                print(f"repeat {r} {name}: first beat {res[name][-1][0]:.2f} s, "
                      f"regain {res[name][-1][1]:.2f} s", flush=True)
    ok = res[next(iter(MODES))]
    anchor = statistics.median(x[1] for x in ok) if ok else float("nan")
    print(f"\nSIGKILL of 1 of 2 gloo workers at step {a.kill_at}; medians over the runs "
          "that recovered")
    print(f"{'mode':<46} {'recovered':>9} {'first beat s':>12} {'regain s':>9} {'vs anchor':>9}")
    for name, xs in res.items():
        n = f"{len(xs)}/{len(xs) + len(failed[name])}"
        if not xs:
            print(f"{name:<46} {n:>9} {'-':>12} {'-':>9} {'-':>9}")
            continue
        f, g = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
        print(f"{name:<46} {n:>9} {f:>12.2f} {g:>9.2f} {g / anchor:>8.2f}x")


if __name__ == "__main__":
    main()
