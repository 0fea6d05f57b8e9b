"""Test-only training script for the supervisor tests: a tiny data-parallel regression on
gloo with the project's MetricLog and heartbeat, checkpointed by rank 0.

``--ckpt-kind unbroken`` uses the real ``unbroken.ckpt.Checkpointer`` (single-rank jobs only:
its DCP save is a collective, so rank 0 saving alone while the other ranks train deadlocks;
the hang watchdog test caught exactly that). ``--ckpt-kind file`` keeps a tiny progress file
(step + weights, published with ``atomic_write_bytes``) and marks "loaded" itself.
The other ranks receive the restored weights by broadcast. Every rank beats each step.
On SIGTERM (preemption) rank 0 saves the step it just finished and the job stops cleanly
(single-rank runs: the ranks do not agree on a common stopping step here) -- unless
``peer_failed()`` says a rank died, then it exits at once, as the Checkpointer does.

Every rank marks ``startup`` after its first step with the times (Unix seconds) at which
its script started, its imports were done, the process group was up, the restore was done
and the first step finished: benchmarks/elastic_recovery.py splits recovery time with them.
``--linger S`` makes a rank whose collective failed (a peer died) stay alive S more seconds
ignoring SIGTERM, like a rank stuck on a save it can never finish.
``--stderr-noise TEXT`` prints TEXT to stderr at start (old warnings in a rank's log).
``--refuse-restore``: rank 0 refuses any checkpoint it restores as the checkpoint layer
does when the job cannot take it (``RestoreRefused``).
``--memory-every K`` (with ``--ckpt-kind unbroken``): the Checkpointer's memory tier publishes
every K steps (issue 25), into the directory ``unbroken run`` names in ``UNBROKEN_MEMORY_TIER``.
``--stop-file PATH``: the job finishes after the first step at which PATH exists (the ranks
agree on that step by an all-reduce), so a test decides when it has seen enough.
``--ignore-sigterm``: the worker ignores SIGTERM (it ends only by torchrun's SIGKILL).
``--start-gate PATH``: every rank waits for PATH to exist before it joins the process group
(so a test knows that no rank has beaten yet).
After the loop every rank calls ``finishing()``; ``--final-wait S`` then makes it take S more
seconds before it exits (a final save or teardown longer than ``--hang-timeout``).
``startup`` also carries ``master_port_held`` (rank 0: ``MASTER_PORT`` was held for it until
it hosted the group's store; None on other ranks), ``memory_tier_left_to_agent`` (the
memory tier's directory is the agent's, removed by it when the job ends; None: none named), ``cpu_start``/``cpu_restored`` (this process's CPU-seconds, all
threads), ``run_*``/``runq_*`` (its main thread's seconds on a CPU and waiting for one,
``/proc/self/schedstat``): the load's own cost, apart from the box's load.

    torchrun ... elastic_train.py --ckpt DIR --metrics FILE --steps N [--save-every K]
        [--sleep S] [--raise-at STEP] [--ckpt-kind unbroken|file] [--linger S]
        [--stderr-noise TEXT] [--stop-file PATH] [--refuse-restore] [--memory-every K]
        [--ignore-sigterm] [--start-gate PATH]
"""

from __future__ import annotations

import time

T_START = time.time()
CPU_START = time.process_time()


def _sched() -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting for one) of this process's main thread
    (``/proc/self/schedstat``; zeros where unknown)."""
    try:
        with open("/proc/self/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


SCHED_START = _sched()

import argparse  # noqa: E402 - the start time is taken before the imports it measures
import errno  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from unbroken.common import memdir  # noqa: E402
from unbroken.common.fs import atomic_write_bytes  # noqa: E402
from unbroken.common.metrics import MetricLog  # noqa: E402
from unbroken.elastic import beat, finishing, install, mark, peer_failed  # noqa: E402

T_IMPORTED = time.time()


def _master_port_held() -> bool | None:
    """Rank 0, before it hosts the group's store: whether ``MASTER_PORT`` is held (by the
    agent of ``unbroken run``) so that no other socket can take it first; None elsewhere."""
    if os.environ.get("RANK") != "0" or "MASTER_PORT" not in os.environ:
        return None
    with socket.socket() as s:  # no SO_REUSEADDR: any socket bound to the port refuses it
        try:
            s.bind(("", int(os.environ["MASTER_PORT"])))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


class _FileCkpt:
    """Rank-0-only progress file: {"step", "model"}; restores the metric log too."""

    def __init__(self, root: str, model: torch.nn.Module, metrics: MetricLog, every: int):
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, "progress.pt")
        self.model, self.metrics, self.every = model, metrics, every
        self.last_save_seconds = 0.0

    def restore(self) -> int | None:
        t0 = time.perf_counter()
        if not os.path.exists(self.path):
            return None
        sd = torch.load(self.path, weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.metrics.load_state_dict({"step": int(sd["step"])})
        mark("loaded", step=int(sd["step"]), seconds=time.perf_counter() - t0)
        return int(sd["step"])

    def maybe_save(self, step: int) -> bool:
        if step % self.every:
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save({"step": step, "model": self.model.state_dict()}, buf)
        # no fsync: durability across power loss is the checkpointer tests' business, and
        # a slow fsync on a busy CI disk would only make the hang tests noisy
        atomic_write_bytes(self.path, buf.getvalue(), fsync=False)
        self.last_save_seconds = time.perf_counter() - t0


def _restore_refused(step: int) -> Exception:
    """What the checkpoint layer raises when the live job cannot take an intact checkpoint
    (a resize it refuses, a shape mismatch): ``unbroken.ckpt.RestoreRefused`` (issue 21 item 8)."""
    from unbroken.ckpt import RestoreRefused

    return RestoreRefused(
        f"checkpoint step {step} was saved by 2 ranks and this job has 1: per-rank state "
        "['extra'] differs between the saving ranks. Resume with 2 ranks"
    )


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=0.05)
    ap.add_argument("--raise-at", type=int, default=None)
    ap.add_argument("--ckpt-kind", choices=("unbroken", "file"), default="file")
    ap.add_argument("--linger", type=float, default=0.0)
    ap.add_argument("--stderr-noise", default=None)
    ap.add_argument("--stop-file", default=None)
    ap.add_argument("--refuse-restore", action="store_true")
    ap.add_argument("--memory-every", type=int, default=None)
    ap.add_argument("--ignore-sigterm", action="store_true")  # until torchrun's SIGKILL
    ap.add_argument("--start-gate", default=None)
    ap.add_argument("--final-wait", type=float, default=0.0)  # after finishing(): a slow end
    a = ap.parse_args()
    if a.stderr_noise:
        print(a.stderr_noise, file=sys.stderr, flush=True)

    preempted: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        if peer_failed() and not a.linger:  # a rank died: a save could never finish
            os._exit(143)
        preempted.append(signum)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if a.ignore_sigterm else on_sigterm)
    install()  # stack dumps work from here on: a hang in init_process_group included
    gate_deadline = time.monotonic() + 300
    while a.start_gate and not os.path.exists(a.start_gate) and time.monotonic() < gate_deadline:
        time.sleep(0.05)  # a test's gate (polled: it opens when the test has seen enough)
    held = _master_port_held()
    dist.init_process_group("gloo")
    t_pg = time.time()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    metrics = MetricLog(a.metrics) if rank == 0 else None
    ckpt: Any = None
    if rank == 0 and metrics is not None:
        if a.ckpt_kind == "unbroken":
            from unbroken.ckpt import Checkpointer, TrainState  # DCP import costs ~1 s

            ckpt = Checkpointer(
                a.ckpt,
                TrainState(model=model, optimizer=opt, metrics=metrics),
                every_steps=a.save_every,
                keep_last=3,
                memory_every_steps=a.memory_every,
            )
        else:
            ckpt = _FileCkpt(a.ckpt, model, metrics, a.save_every)
    t0 = time.perf_counter()
    start = torch.full((1,), -1, dtype=torch.int64)
    if ckpt is not None:
        restored = ckpt.restore()  # marks "loaded" with step and seconds
        if a.refuse_restore and restored is not None:
            raise _restore_refused(restored)
        start[0] = -1 if restored is None else restored
    dist.broadcast(start, 0)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    if rank != 0 and int(start[0]) >= 0:  # these ranks "loaded" through the broadcast
        mark("loaded", step=int(start[0]), seconds=time.perf_counter() - t0)
    times: dict[str, Any] = {"t_start": T_START, "imported": T_IMPORTED, "pg": t_pg}
    times.update(restored=time.time(), master_port_held=held)
    tier = os.environ.get(memdir.ENV, "")
    times.update(memory_tier_left_to_agent=memdir.agent_removes(tier) if tier else None)
    times.update(cpu_start=CPU_START, cpu_restored=time.process_time())
    sched = _sched()
    times.update(run_start=SCHED_START[0], run_restored=sched[0])
    times.update(runq_start=SCHED_START[1], runq_restored=sched[1])
    start.clamp_(min=0)
    try:
        train(a, model, opt, metrics, ckpt, int(start[0]), preempted, times)
    except RuntimeError:
        if a.linger:  # a peer died mid-collective; stay (SIGTERM only sets a flag)
            end = time.time() + a.linger
            while time.time() < end:
                time.sleep(0.05)
        raise
    finishing()
    time.sleep(a.final_wait)  # a final save or teardown longer than --hang-timeout
    dist.barrier()
    if metrics is not None:
        metrics.close()
    dist.destroy_process_group()


def train(
    a: argparse.Namespace,
    model: torch.nn.Module,
    opt: Any,
    metrics: MetricLog | None,
    ckpt: Any,
    first: int,
    preempted: list[int],
    times: dict[str, Any],
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = getattr(ckpt, "state", None)
    for step in range(first, a.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 4, generator=g)
        y = x.sum(1, keepdim=True)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        done = step + 1
        if a.raise_at is not None and done == a.raise_at and rank == 0:
            raise ValueError(f"boom at step {done}")
        beat(done)
        if step == first:
            mark("startup", step=done, first_step=time.time(), **times)
        if ckpt is not None and metrics is not None:
            metrics.log(
                done,
                loss=loss.item(),
                world_size=world,
                attempt=int(os.environ.get("UNBROKEN_ATTEMPT", "-1")),
            )
            if state is not None:
                state.step = done
            saved = ckpt.maybe_save(done)
            if preempted and not saved:
                ckpt.save(done)
                saved = True
            if saved:
                mark("saved", step=done, seconds=ckpt.last_save_seconds, preempted=bool(preempted))
        if preempted:
            break
        if a.stop_file is not None:
            stop = torch.tensor([float(os.path.exists(a.stop_file))])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
        time.sleep(a.sleep)


if __name__ == "__main__":
    main()
