"""Recovery after a SIGKILLed worker: `unbroken run` vs torchrun's own restart, by phase.

Same 2-worker gloo job (tests/integration/scripts/elastic_train.py, a checkpoint every 5
steps), same kill (rank 1 SIGKILLed), at two moments (issue 23: the cold path beside the warm):

- late: once both ranks passed ``--kill-at`` and, for `unbroken run` with its standby, once
  the standby agent for the next attempt is ready (the steady state of a job that has
  trained a while);
- early: once both ranks passed ``--kill-early-at`` (just after the first checkpoint),
  without waiting for anything: for `unbroken run` the standby is usually not ready yet
  (whether it was is recorded per run and counted in the table).

Rows, each against torchrun's own restart at the same moment, same run: (a) `unbroken run`,
standby ready; (b) `unbroken run --no-prewarm` (a bare standby agent, which forks its fork
server at the restart and the workers from it; fresh interpreters before issue 23 item 2); (c) `unbroken run`, a failure before the standby is ready (the failed
attempt's agent is kept and restarts only the workers; column "kept": how many runs did);
(d) `unbroken run --no-standby` (nothing held while training, fresh workers; since issue
23 the running agent is kept and restarts them, as torchrun does). The anchor is ``torchrun --standalone --max-restarts 1`` (restarts the
worker group inside the running agent) with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without
it the restarted group usually fails to connect, see RESULTS.md; ``--plain-torchrun`` adds
that row too). The anchor runs get UNBROKEN_RUN_DIR set by hand so the same script writes
the same beats and marks.

What the standby costs (mode a, when its ``standby`` event for attempt 1 appears): the
resident memory (RSS and PSS, MB) and the CPU-seconds (user + system) of its processes (the
waiting agent and its fork server), read from /proc; one standby per attempt.

Phases, measured identically for every mode (K = the SIGKILL):

- detect:   K -> the launcher knows (unbroken: the supervisor's ``t_detect``; torchrun: the
            time stamp of its first log line about the failure);
- relaunch: -> the first restarted worker's script starts running (its first line);
- load:     -> every restarted rank restored the checkpoint (imports, process group,
            restore; split below into imports / init_process_group / restore);
- catch-up: -> a restarted worker beats the step reached before K.

The load of each restarted rank is also split by where its time went: its CPU-seconds (all
threads), and its main thread's time running, waiting for a CPU (run queue) and blocked
(the rest), from the worker's own counters: like for like whatever else the box runs
(issue 23).

Memory once back where it was: the PSS of the job's processes up to the restarted attempt
(no standby waiting for a later one), for every row (issue 23 item 2).

``--first-step`` measures instead the job's start: seconds from ``unbroken run`` (defaults,
``--standby-start launch``, ``--no-prewarm``, ``--no-standby``) and from torchrun to the
first step on every rank, interleaved.

regain = the sum = K -> back where it was. Modes run interleaved (order rotated per repeat),
so machine load hits all alike; the table shows medians and each mode's regain over the
anchor's at the same kill moment, same run; the goals of issue 23 follow as PASS / FAIL.
Before the runs, the cost of the parts (interpreter, ``import torch``, torchrun's and the
checkpointer's imports) is timed on the box as it is.

    flock /tmp/unbroken-bench.lock .venv/bin/python benchmarks/elastic_recovery.py --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from unbroken.common import events
from unbroken.common.procs import cmdline, environ_of, kill_matching, pids_with_env
from unbroken.elastic import heartbeat
from unbroken.elastic.launch.worker import FORKSERVER_TITLE

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "tests", "integration", "scripts", "elastic_train.py")
ANCHOR = "torchrun + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (anchor)"
ANCHOR_EARLY = "anchor, early kill"
PLAIN = "torchrun --max-restarts 1 (defaults)"
# name -> (launcher and its options, kill moment)
MODES: dict[str, tuple[list[str], str]] = {
    "(a) unbroken run, standby ready": (["unbroken"], "late"),
    "(b) unbroken run --no-prewarm": (["unbroken", "--no-prewarm"], "late"),
    "(d) unbroken run --no-standby": (["unbroken", "--no-standby"], "late"),
    ANCHOR: (["torchrun", "noshare"], "late"),
    "(c) unbroken run, killed before the standby is ready": (["unbroken"], "early"),
    ANCHOR_EARLY: (["torchrun", "noshare"], "early"),
}
# issue 23's goals: regain vs the anchor at the same kill moment, and detect
GOALS = {
    "(a) unbroken run, standby ready": 0.3,
    "(b) unbroken run --no-prewarm": 1.0,
    "(c) unbroken run, killed before the standby is ready": 1.0,
}
GOAL_DETECT = 1.0
STANDBY = "unbroken.elastic.launch.standby"
PHASES = ("detect", "relaunch", "load", "catch_up", "regain")
PARTS = ("imports", "pg_init", "restore", "first_step", "stop")
# Where each restarted rank's load went (mean over the ranks, s): its CPU-seconds (all
# threads); its main thread on a CPU, waiting for one (run queue), neither (blocked: I/O,
# the other rank, ...). Equal CPU and blocked time with more run-queue wait = the box's
# load, not the launcher.
LOAD_SPLIT = ("load_cpu", "load_run", "load_runq", "load_blocked")
HUNG_AFTER = 90.0
# glog prefix of torchrun's own log lines: "W1201 15:03:36.758000 14822 file:line] msg"
_GLOG = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) ")


def _beats(run_dir: str) -> list[heartbeat.BeatRecord]:
    out = []
    for d in glob.glob(os.path.join(run_dir, "beats", "a*")):
        out += heartbeat.read_beats(run_dir, int(os.path.basename(d)[1:]))
    return [b for b in out if b.started]


def _torchrun_detect(log_path: str, t_kill: float) -> float | None:
    """Unix time of torchrun's first log line about the failure after ``t_kill``."""
    year = datetime.datetime.fromtimestamp(t_kill).year
    with open(log_path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", "replace")
            m = _GLOG.match(line)
            if not m or not re.search(r"FAILED|failed|closing signal|Stopping worker", line):
                continue
            mo, d, hh, mm, ss, frac = m.groups()
            t = datetime.datetime(
                year, int(mo), int(d), int(hh), int(mm), int(ss), int(frac.ljust(6, "0")[:6])
            ).timestamp()
            if t >= t_kill - 0.01:
                return t
    return None


def _standby_ready(run_dir: str) -> bool:
    return any(
        e["event"] == "standby" and e.get("attempt") == 1 for e in events.load_events(run_dir)
    )


def _proc_cost(pid: int) -> tuple[float, float, float] | None:
    """(RSS MB, PSS MB, CPU-seconds user + system) of ``pid`` from /proc, None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        with open(f"/proc/{pid}/smaps_rollup") as f:
            pss = next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, StopIteration, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime: fields 14, 15 of stat
    return rss / 1024, pss / 1024, cpu


def _is_standby(argv: list[str]) -> bool:
    """A standby agent (its argv) or its fork server (which titles itself)."""
    return STANDBY in argv or bool(argv) and argv[0].startswith(FORKSERVER_TITLE)


def standby_cost(run_dir: str, attempt: int) -> dict[str, float]:
    """Memory and CPU of the standby processes waiting for ``attempt`` (its agent and fork
    server: a standby's own command line, that attempt's environment)."""
    got = [
        c
        for pid in pids_with_env(events.ENV_ATTEMPT, str(attempt))
        if _is_standby(cmdline(pid)) and environ_of(pid).get(events.ENV_RUN_DIR) == run_dir
        for c in [_proc_cost(pid)]
        if c is not None
    ]
    return {
        "standby_procs": len(got),
        "standby_rss_mb": sum(c[0] for c in got),
        "standby_pss_mb": sum(c[1] for c in got),
        "standby_cpu_s": sum(c[2] for c in got),
    }


def _start(mode: list[str], work: str) -> tuple[subprocess.Popen[bytes], str, str, Any]:
    """Start the job under ``mode``: (process, run dir, log path, open log file)."""
    run_dir = os.path.join(work, "run")
    os.makedirs(run_dir)
    script = [
        SCRIPT,
        "--ckpt",
        os.path.join(work, "ckpt"),
        "--metrics",
        os.path.join(work, "m.jsonl"),
        "--steps",
        "100000",
        "--save-every",
        "5",
    ]
    env = dict(os.environ)
    if mode[0] == "torchrun":
        env.update({events.ENV_RUN_DIR: run_dir, events.ENV_ATTEMPT: "0"})
        if "noshare" in mode:  # what `unbroken run` sets for its agents
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            *script,
        ]
    else:
        argv = [
            sys.executable,
            "-m",
            "unbroken.cli",
            "run",
            "--run-dir",
            run_dir,
            "-q",
            "--nproc-per-node",
            "2",
            *mode[1:],
            "--",
            *script,
        ]
    log_path = os.path.join(work, "log.txt")
    log = open(log_path, "wb")
    p = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return p, run_dir, log_path, log


def _end(p: subprocess.Popen[bytes], run_dir: str, log: Any) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    kill_matching(events.ENV_RUN_DIR, run_dir, timeout=5)
    p.wait()
    log.close()


def first_step(mode: list[str], work: str) -> dict[str, float]:
    """Seconds from starting the job under ``mode`` to its first step on every rank (the
    slower rank's ``startup`` mark), and, for ``unbroken run`` with a standby, to the next
    attempt's standby being ready."""
    standby = mode[0] == "unbroken" and "--no-standby" not in mode
    t0 = time.time()
    p, run_dir, _log_path, log = _start(mode, work)
    try:
        out: dict[str, float] = {}
        deadline = t0 + 120.0
        while "first_step" not in out or ("ready" not in out and standby):
            ev = events.load_events(run_dir)
            ups = [e for e in ev if e["event"] == "startup" and e.get("attempt") == 0]
            if len(ups) >= 2 and "first_step" not in out:
                out["first_step"] = max(e["first_step"] for e in ups) - t0
            ready = [e["t"] for e in ev if e["event"] == "standby" and e.get("attempt") == 1]
            if ready and "first_step" in out:
                out["ready"] = ready[0] - t0
            if time.time() > deadline:
                raise _Failed("no first step / standby in 120 s", work)
            _alive(p, work, "before the first step")
            time.sleep(0.02)
        return out
    finally:
        _end(p, run_dir, log)


def job_memory(run_dir: str, attempt: int) -> dict[str, float]:
    """PSS (MB) of the job's processes up to ``attempt`` (agent, a kept agent born for an
    earlier attempt, fork server, launchers, workers; not a standby waiting for a later
    attempt) once it is back where it was: the memory a restart leaves behind, like for like
    (issue 23 item 2)."""
    got = [
        c[1]
        for pid in pids_with_env(events.ENV_RUN_DIR, run_dir)
        if int(environ_of(pid).get(events.ENV_ATTEMPT) or 0) <= attempt
        for c in [_proc_cost(pid)]
        if c is not None
    ]
    return {"job_pss_mb": sum(got), "job_procs": float(len(got))}


def one(mode: list[str], moment: str, work: str, kill_at: int) -> dict[str, float]:
    p, run_dir, log_path, log = _start(mode, work)
    prewarm = mode[0] == "unbroken" and "--no-standby" not in mode
    wait_ready = prewarm and moment == "late"
    extra: dict[str, float] = {}
    try:
        while True:
            bs = _beats(run_dir)
            ready = not wait_ready or _standby_ready(run_dir)
            if len(bs) >= 2 and min(b.step for b in bs) >= kill_at and ready:
                break
            _alive(p, work, "before the kill")
            time.sleep(0.02)
        if wait_ready:  # what the waiting standby holds and has spent (issue 23)
            extra = standby_cost(run_dir, 1)
        if prewarm:
            extra["standby_ready_at_kill"] = float(_standby_ready(run_dir))
        old = {b.pid for b in bs}
        reached = max(b.step for b in bs)
        victim = max(bs, key=lambda b: b.rank)
        t_kill = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        regain = None
        while regain is None:
            if any(b.step >= reached for b in _beats(run_dir) if b.pid not in old):
                regain = time.time()
            elif time.time() - t_kill > HUNG_AFTER:
                raise _Failed(f"no progress {HUNG_AFTER:g} s after the kill (hung)", work)
            _alive(p, work, "after the kill")
            time.sleep(0.01)
        extra.update(job_memory(run_dir, 0 if mode[0] == "torchrun" else 1))
        return {**_phases(mode, run_dir, log_path, old, t_kill, regain), **extra}
    finally:
        _end(p, run_dir, log)


def _phases(
    mode: list[str], run_dir: str, log_path: str, old: set[int], t_kill: float, regain: float
) -> dict[str, float]:
    deadline = time.time() + 10.0
    while True:  # the restarted ranks' "startup" marks follow their first step
        ev = events.load_events(run_dir)
        ups = [
            e
            for e in ev
            if e["event"] == "startup" and e["pid"] not in old and e["t_start"] > t_kill
        ]
        if len(ups) >= 2 or time.time() > deadline:
            break
        time.sleep(0.05)
    if len(ups) < 2:
        raise RuntimeError(f"restarted ranks did not mark startup: {ups}")
    out: dict[str, float] = {}
    if mode[0] == "unbroken":
        (fail,) = [e for e in ev if e["event"] == "failure"]
        t_detect = float(fail["t_detect"])
        relaunch = [e for e in ev if e["event"] == "launch" and e.get("attempt") == 1]
        out["kept"] = float(bool(relaunch and relaunch[0].get("kept")))
        stop = [e for e in ev if e["event"] == "stop_group"]
        if stop:
            out["stop"] = float(stop[0]["seconds"])
    else:
        found = _torchrun_detect(log_path, t_kill)
        if found is None:
            raise RuntimeError("no torchrun log line about the failure")
        t_detect = found
    start = min(e["t_start"] for e in ups)
    restored = max(e["restored"] for e in ups)
    out.update(
        detect=t_detect - t_kill,
        relaunch=start - t_detect,
        load=restored - start,
        catch_up=regain - restored,
        regain=regain - t_kill,
        imports=max(e["imported"] - e["t_start"] for e in ups),
        pg_init=max(e["pg"] - e["imported"] for e in ups),
        restore=max(e["restored"] - e["pg"] for e in ups),
        first_step=max(e["first_step"] - e["restored"] for e in ups),
    )
    if all("cpu_restored" in e for e in ups):
        cpu = [e["cpu_restored"] - e["cpu_start"] for e in ups]
        run = [e["run_restored"] - e["run_start"] for e in ups]
        runq = [e["runq_restored"] - e["runq_start"] for e in ups]
        wall = [e["restored"] - e["t_start"] for e in ups]
        out.update(
            load_cpu=statistics.fmean(cpu),
            load_run=statistics.fmean(run),
            load_runq=statistics.fmean(runq),
            load_blocked=statistics.fmean(
                w - r - q for w, r, q in zip(wall, run, runq, strict=True)
            ),
        )
    return out


class _Failed(RuntimeError):
    def __init__(self, what: str, work: str) -> None:
        with open(os.path.join(work, "log.txt"), "rb") as f:
            tail = f.read().decode("utf-8", "replace").splitlines()
        lines = [ln for ln in tail if "Error" in ln or "error" in ln][-3:]
        super().__init__(f"{what}; last errors: {' | '.join(lines)[:600]}")


def _alive(p: subprocess.Popen[bytes], work: str, when: str) -> None:
    if p.poll() is not None:
        raise _Failed(f"job exited {p.returncode} {when}", work)


def startup_costs(repeats: int) -> dict[str, float]:
    """Median wall seconds of each start-up part, each in a fresh interpreter."""
    py = sys.executable
    cases = {
        "python -c pass": [py, "-c", "pass"],
        "python -S (the launcher's start)": [py, "-S", "-c", "pass"],
        "import torch": [py, "-c", "import torch"],
        "+ torch.distributed.run (agent)": [py, "-c", "import torch, torch.distributed.run"],
        "+ unbroken.ckpt (checkpointer)": [py, "-c", "import torch, unbroken.ckpt"],
    }
    got: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, cmd in cases.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            got[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in got.items()}


def _med(xs: list[dict[str, float]], k: str) -> float:
    vals = [x[k] for x in xs if k in x]
    return statistics.median(vals) if vals else float("nan")


def report(res: dict[str, list[dict[str, float]]], failed: dict[str, list[str]]) -> dict[str, Any]:
    anchor = {
        m: _med(res.get(ANCHOR if m == "late" else ANCHOR_EARLY, []), "regain")
        for m in ("late", "early")
    }
    print("\nSIGKILL of 1 of 2 gloo workers; medians (s) over the runs that recovered")
    print(
        "| mode | kill | recovered | standby ready at the kill | kept agent | "
        + " | ".join(PHASES)
        + " | vs torchrun, same kill |"
    )
    print("|---|---|---|---|---|" + "---|" * len(PHASES) + "---|")
    ratios: dict[str, float] = {}
    for name, xs in res.items():
        moment = MODES[name][1] if name in MODES else "late"
        n = f"{len(xs)}/{len(xs) + len(failed[name])}"
        ready = [x["standby_ready_at_kill"] for x in xs if "standby_ready_at_kill" in x]
        rd = f"{int(sum(ready))}/{len(ready)}" if ready else "-"
        kept = [x["kept"] for x in xs if "kept" in x]
        rd += f" | {int(sum(kept))}/{len(kept)}" if kept else " | -"
        if not xs:
            print(f"| {name} | {moment} | {n} | {rd} |" + " |" * (len(PHASES) + 1))
            continue
        ratios[name] = _med(xs, "regain") / anchor[moment]
        print(
            f"| {name} | {moment} | {n} | {rd} | "
            + " | ".join(f"{_med(xs, k):.2f}" for k in PHASES)
            + f" | {ratios[name]:.2f}x |"
        )
    print("\nload split (medians, s; slowest rank):")
    print("| mode | " + " | ".join(PARTS) + " |")
    print("|---|" + "---|" * len(PARTS))
    for name, xs in res.items():
        if xs:
            print(f"| {name} | " + " | ".join(f"{_med(xs, k):.2f}" for k in PARTS) + " |")
    print("\nwhere a restarted rank's load went (medians of the mean over ranks, s):")
    print("| mode | CPU-s (all threads) | main thread: running | waiting for a CPU | blocked |")
    print("|---|---|---|---|---|")
    for name, xs in res.items():
        if xs and all(k in xs[0] for k in LOAD_SPLIT):
            print(f"| {name} | " + " | ".join(f"{_med(xs, k):.2f}" for k in LOAD_SPLIT) + " |")
    print("\nPSS of the job's processes once back where it was (agent, fork server, launchers,")
    print("workers of the restarted attempt; no waiting standby), median MB:")
    for name, xs in res.items():
        if xs and "job_pss_mb" in xs[0]:
            print(f"  {name}: {_med(xs, 'job_pss_mb'):.0f} ({_med(xs, 'job_procs'):.0f} processes)")
    for name, xs in res.items():
        cost = [x for x in xs if "standby_rss_mb" in x]
        if cost:
            print(
                f"\n{name}: standby cost per attempt (median of {len(cost)}; its agent and "
                f"fork server, when ready): RSS {_med(cost, 'standby_rss_mb'):.0f} MB, PSS "
                f"{_med(cost, 'standby_pss_mb'):.0f} MB, CPU {_med(cost, 'standby_cpu_s'):.2f} "
                f"s (processes: {_med(cost, 'standby_procs'):.0f})"
            )
    print("\n| goal (issue 23) | measured | goal | verdict |")
    print("|---|---|---|---|")
    for name, goal in GOALS.items():
        if name not in res:
            continue
        r = ratios.get(name, float("nan"))
        print(
            f"| {name}: regain vs torchrun | {r:.2f}x | <= {goal}x | {'PASS' if r <= goal else 'FAIL'} |"
        )
    for name in GOALS:
        if res.get(name):
            d = max(x["detect"] for x in res[name])
            print(
                f"| {name}: detect, worst run | {d:.2f} s | <= {GOAL_DETECT} s | {'PASS' if d <= GOAL_DETECT else 'FAIL'} |"
            )
    return {"anchor": anchor, "ratios": ratios}


FIRST_STEP_MODES: dict[str, list[str]] = {
    "unbroken run (defaults)": ["unbroken"],
    "unbroken run --standby-start launch": ["unbroken", "--standby-start", "launch"],
    "unbroken run --no-prewarm": ["unbroken", "--no-prewarm"],
    "unbroken run --no-standby": ["unbroken", "--no-standby"],
    ANCHOR: ["torchrun", "noshare"],
}


def first_steps(repeats: int, json_path: str | None) -> None:
    """The job's start: ``unbroken run`` in its start-up modes vs torchrun, interleaved."""
    load0 = os.getloadavg()
    print(f"load average: {load0}", flush=True)
    res: dict[str, list[dict[str, float]]] = {k: [] for k in FIRST_STEP_MODES}
    names = list(FIRST_STEP_MODES)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for i, name in enumerate(names[r % len(names) :] + names[: r % len(names)]):
                got = first_step(FIRST_STEP_MODES[name], os.path.join(tmp, f"{r}-{i}"))
                res[name].append(got)
                print(f"repeat {r} {name}: " + " ".join(f"{k} {v:.2f}" for k, v in got.items()))
    load1 = os.getloadavg()
    anchor = res[ANCHOR]
    print(
        "\n| start | first step on every rank (median s) | per repeat | vs the anchor, same repeat | next standby ready (median s) |"
    )
    print("|---|---|---|---|---|")
    for name, xs in res.items():
        per = " / ".join(f"{x['first_step']:.2f}" for x in xs)
        vs = " / ".join(
            f"{x['first_step'] / a['first_step']:.2f}x" for x, a in zip(xs, anchor, strict=True)
        )
        ready = f"{_med(xs, 'ready'):.2f}" if "ready" in xs[0] else "-"
        print(f"| {name} | {_med(xs, 'first_step'):.2f} | {per} | {vs} | {ready} |")
    print(f"\nload average before {load0}, after {load1}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"first_step": res, "load": [load0, load1]}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=15)
    ap.add_argument(
        "--kill-early-at",
        type=int,
        default=6,
        help="step of the early kill (before the standby is ready)",
    )
    ap.add_argument("--plain-torchrun", action="store_true", help=f"also the row {PLAIN!r}")
    ap.add_argument("--json", default=None, help="also write every repeat's phases here")
    ap.add_argument(
        "--modes",
        default=None,
        help="comma-separated letters of the rows to run (e.g. 'b,d'; the anchors always run)",
    )
    ap.add_argument(
        "--first-step",
        action="store_true",
        help="only the job's start: seconds to the first step on every rank, unbroken run's "
        "start-up modes and torchrun, interleaved",
    )
    a = ap.parse_args()
    if a.first_step:
        first_steps(a.repeats, a.json)
        return
    modes = dict(MODES)
    if a.modes:
        keep = {f"({x.strip()})" for x in a.modes.split(",")}
        modes = {k: v for k, v in modes.items() if k in (ANCHOR, ANCHOR_EARLY) or k[:3] in keep}
        if not any(v[1] == "early" for k, v in modes.items() if k != ANCHOR_EARLY):
            modes.pop(ANCHOR_EARLY)
    if a.plain_torchrun:
        modes[PLAIN] = (["torchrun"], "late")
    load0 = os.getloadavg()
    print(f"load average: {load0}", flush=True)
    costs = startup_costs(a.repeats)
    print("start-up parts (median wall s, fresh interpreter each):")
    for k, v in costs.items():
        print(f"  {k:<36} {v:6.2f}")
    res: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    failed: dict[str, list[str]] = {m: [] for m in modes}
    names = list(modes)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for i, name in enumerate(names[r % len(names) :] + names[: r % len(names)]):
                mode, moment = modes[name]
                at = a.kill_at if moment == "late" else a.kill_early_at
                try:
                    ph = one(mode, moment, os.path.join(tmp, f"{r}-{i}"), at)
                except (_Failed, RuntimeError) as e:
                    failed[name].append(str(e))
                    print(f"repeat {r} {name}: FAILED: {e}", flush=True)
                    continue
                res[name].append(ph)
                print(
                    f"repeat {r} {name}: " + " ".join(f"{k} {v:.2f}" for k, v in ph.items()),
                    flush=True,
                )
    load1 = os.getloadavg()
    out = report(res, failed)
    print(f"\nload average before {load0}, after {load1}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"costs": costs, "runs": res, "failed": failed, "load": [load0, load1], **out},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
