"""The drill's hands: supervised nodes it starts and watches, and one injector per fault.

Every injection is real: signals go to the real worker or agent processes (found through the
heartbeat beacons, see :mod:`heartbeat`), files of real checkpoints are bit-flipped or
truncated on disk, and the checkpoint directory is replaced by a plain file (which root
cannot write through, unlike a ``chmod``).

Processes are found as the supervisor tests find them: each worker's beacon names its pid
and rank; ``_procs.agent_of`` finds its torchrun agent; everything below one supervisor carries
``UNBROKEN_RUN_DIR=<its run dir>`` and everything the drill starts carries
``UNBROKEN_DRILL_TOKEN``, which is what cleanup kills by (see ``_procs.kill_matching``).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import re
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from unbroken.ckpt.memtier import HEADER_BYTES, SlotStore
from unbroken.ckpt.replica import PREFIX as REPLICA_PREFIX
from unbroken.ckpt.replica import _check as slot_header
from unbroken.ckpt.store import Store
from unbroken.common import events, memdir
from unbroken.common.fs import open_private, private_dir
from unbroken.common.procs import agent_of, environ_of, is_alive, kill_matching
from unbroken.elastic import heartbeat
from unbroken.elastic.drill.plan import FaultSpec, Injection

__all__ = ["Ctx", "Node", "inject"]

log = logging.getLogger(__name__)

_TMP_SAVE = re.compile(r"^\.tmp-step-(\d+)\.[0-9a-f]{8}$")  # not ".deleting": retention


class Node:
    """One ``unbroken run`` supervisor started by the drill (a node of the job)."""

    def __init__(self, name: str, sup_dir: str, argv: Sequence[str], env: dict[str, str]) -> None:
        self.name = name
        self.sup_dir = private_dir(os.path.abspath(sup_dir), purpose="run directory")
        self.out_path = os.path.join(self.sup_dir, "supervisor.out")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self._out: IO[bytes] = os.fdopen(open_private(self.out_path, flags), "wb")
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        self.t_start = time.time()
        self._events: list[dict[str, Any]] = []
        self._events_at = 0.0

    def events(self, fresh: bool = False) -> list[dict[str, Any]]:
        """The supervisor's events (re-read at most every 50 ms unless ``fresh``)."""
        now = time.monotonic()
        if fresh or now - self._events_at > 0.05:
            self._events = events.load_events(self.sup_dir)
            self._events_at = now
        return self._events

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def hosting(self) -> bool:
        return any(e["event"] == "start" and e.get("hosting") for e in self.events())

    def live_beats(self, since: float) -> list[heartbeat.BeatRecord]:
        """Started beacons of live workers in attempts launched after ``since``: only
        processes of this node's job (a beacon's pid is a claim; it is signalled next)."""
        out: list[heartbeat.BeatRecord] = []
        for e in self.events():
            if e["event"] == "launch" and e["t"] > since and type(e.get("attempt")) is int:
                out += [
                    b
                    for b in heartbeat.read_beats(self.sup_dir, e["attempt"])
                    if b.started and self.owns(b.pid)
                ]
        return out

    def owns(self, pid: int) -> bool:
        return is_alive(pid) and environ_of(pid).get(events.ENV_RUN_DIR) == self.sup_dir

    def kill(self) -> None:
        """SIGKILL the supervisor and everything below it: the whole node is gone."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_matching(events.ENV_RUN_DIR, self.sup_dir, timeout=10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10.0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._out.close()


@dataclass
class Ctx:
    """What the injectors need: the nodes, the job's checkpoint root, limits, a trace."""

    nodes: list[Node]
    ckpt_root: str
    deadline: float
    """``time.monotonic()`` after which every wait gives up."""
    outage: float
    world: int
    progress: list[tuple[float, str, int]] = field(default_factory=list)
    """(time, node, highest live step) samples for the timeline plot."""
    start_node: Callable[[str], Node] | None = None
    """Starts one more node of the job by name (a replacement for a lost one)."""
    _last_sample: float = 0.0

    def committed(self) -> list[int]:
        try:
            return Store(self.ckpt_root).steps()
        except (ValueError, OSError):
            return []  # the directory is a file during a storage outage

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def beats(self, since: float) -> dict[str, list[heartbeat.BeatRecord]]:
        out = {n.name: n.live_beats(since) for n in self.nodes}
        now = time.time()
        if now - self._last_sample > 0.05:
            self._last_sample = now
            for name, bs in out.items():
                if bs:
                    self.progress.append((now, name, max(b.step for b in bs)))
        return out

    def wait(self, pred: Callable[[], Any], what: str, interval: float = 0.002) -> Any:
        """Poll ``pred`` until truthy; raise TimeoutError at the deadline and RuntimeError
        when every supervisor has exited."""
        while True:
            v = pred()
            if v:
                return v
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            if not any(n.running for n in self.nodes):
                codes = ", ".join(f"{n.name}: exit {n.proc.returncode}" for n in self.nodes)
                raise RuntimeError(f"the job ended ({codes}) while waiting for {what}")
            time.sleep(interval)

    def wait_step(
        self, step: int, since: float, ranks: int
    ) -> dict[str, list[heartbeat.BeatRecord]]:
        """Live beacons once ``ranks`` workers launched after ``since`` all reached ``step``."""

        def ready() -> dict[str, list[heartbeat.BeatRecord]] | None:
            got = self.beats(since)
            flat = [b for bs in got.values() for b in bs]
            if len(flat) >= ranks and min(b.step for b in flat) >= step:
                return got
            return None

        return self.wait(ready, f"{ranks} worker(s) at step {step}")

    def wait_failure(self, node: Node, after: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next(
                (e for e in node.events() if e["event"] == "failure" and e["t"] >= after), None
            )

        return self.wait(
            found, f"the supervisor of node {node.name} to record the failure", interval=0.05
        )


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_dead(pids: Sequence[int], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while any(is_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.005)


def _victim(
    beats: dict[str, list[heartbeat.BeatRecord]], index: int
) -> tuple[str, heartbeat.BeatRecord]:
    flat = sorted(((n, b) for n, bs in beats.items() for b in bs), key=lambda x: x[1].rank)
    return flat[index % len(flat)]


# --- injectors: each returns with the fault injected (or raises) --------------------------


def _kill_one(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> tuple[str, int]:
    """SIGKILL the seeded victim at its step; returns its node and rank once it is dead."""
    beats = ctx.wait_step(spec.step, since, ctx.world)
    name, b = _victim(beats, spec.victim)
    _signal(b.pid, signal.SIGKILL)
    inj.record(name, b, f"SIGKILL rank {b.rank} (pid {b.pid}) at step {b.step}")
    _wait_dead([b.pid])
    return name, b.rank


def _kill(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    _kill_one(spec, ctx, inj, since)
    steps = ctx.committed()
    inj.expected_restore = steps[-1] if steps else None


def _hang(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    beats = ctx.wait_step(spec.step, since, ctx.world)
    name, b = _victim(beats, spec.victim)
    _signal(b.pid, signal.SIGSTOP)  # alive but silent: only the watchdog can notice
    inj.record(name, b, f"SIGSTOP rank {b.rank} (pid {b.pid}) at step {b.step}")
    steps = ctx.committed()
    # A lower bound only: the watchdog sends SIGCONT with its stack-dump request, and the
    # worker may train (and save) on for up to --dump-grace seconds before the SIGKILL.
    inj.min_restore = steps[-1] if steps else None


def _kill_in_save(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    ctx.wait_step(spec.step, since, ctx.world)
    root = ctx.ckpt_root
    seen = set(_listdir(root))
    want = 1 + spec.salt % 3  # kill once this many files of the save exist (seeded)
    missed = 0

    def saving() -> tuple[str, int] | None:
        for n in _listdir(root):
            m = _TMP_SAVE.match(n)
            if m and n not in seen:
                return n, int(m.group(1))
        return None

    while True:
        name, step = ctx.wait(saving, "a checkpoint save to start", interval=0.0005)
        seen.add(name)
        tmp = os.path.join(root, name)
        end = time.monotonic() + 30.0
        while len(_listdir(tmp)) < want and os.path.isdir(tmp) and time.monotonic() < end:
            time.sleep(0.0002)
        beats = ctx.beats(since)
        writer = next(((n, x) for n, bs in beats.items() for x in bs if x.rank == 0), None)
        if writer is None:
            continue  # rank 0 just died or is not up yet
        node, b = writer
        # Freeze the writer, make sure the save is still unfinished, then SIGKILL it: the
        # kill lands while the temporary directory is half written, never after the commit.
        _signal(b.pid, signal.SIGSTOP)
        if os.path.isdir(tmp) and step not in ctx.committed():
            files = sorted(_listdir(tmp))
            size = sum(_size(os.path.join(tmp, f)) for f in files)
            _signal(b.pid, signal.SIGKILL)
            inj.record(
                node,
                b,
                f"SIGKILL rank 0 (pid {b.pid}) while it wrote the checkpoint of "
                f"step {step} ({len(files)} files, {size} bytes in {name})",
            )
            inj.facts.update(
                tmp_dir=name, save_step=step, tmp_files=files, tmp_bytes=size, saves_missed=missed
            )
            break
        _signal(b.pid, signal.SIGCONT)  # that save committed before we got there: next one
        missed += 1
    for bs in ctx.beats(since).values():  # other ranks of a multi-rank job die with it
        for x in bs:
            _signal(x.pid, signal.SIGKILL)
    _wait_dead([b.pid])
    steps = ctx.committed()
    inj.expected_restore = steps[-1] if steps else None


def _corrupt(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    ctx.wait_step(spec.step, since, ctx.world)
    ctx.wait(lambda: len(ctx.committed()) >= 2, "two committed checkpoints", interval=0.01)
    beats = ctx.beats(since)
    procs = [(n, b) for n, bs in beats.items() for b in bs]
    for _, b in procs:  # freeze the job so nothing is written while we damage the newest
        _signal(b.pid, signal.SIGSTOP)
    steps = ctx.committed()
    newest = steps[-1]
    d = Store(ctx.ckpt_root).step_dir(newest)
    data = sorted(f for f in _listdir(d) if f.endswith(".distcp")) or sorted(
        f for f in _listdir(d) if f != "manifest.json"
    )
    victim = os.path.join(d, data[spec.salt % len(data)])
    size = _size(victim)
    if spec.mode == "bitflip":
        offset, bit = (spec.salt >> 4) % size, (spec.salt >> 1) % 8
        with open(victim, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))
            f.flush()
            os.fsync(f.fileno())
        what = f"flipped bit {bit} of byte {offset}"
    else:
        new = (spec.salt >> 4) % max(1, size)
        os.truncate(victim, new)
        what = f"truncated from {size} to {new} bytes"
    name, b = next(((n, x) for n, x in procs if x.rank == 0), procs[0])
    for _, x in procs:
        _signal(x.pid, signal.SIGKILL)
    inj.record(
        name,
        b,
        f"{what} in step-{newest}/{os.path.basename(victim)}, then SIGKILL at step {b.step}",
    )
    inj.facts.update(
        corrupted_step=newest,
        file=os.path.relpath(victim, ctx.ckpt_root),
        mode=spec.mode,
        detail=what,
    )
    _wait_dead([x.pid for _, x in procs])
    inj.expected_restore = steps[-2]


_NO_TIER = (
    "the job publishes nothing to the memory tier: give its Checkpointer "
    "memory_every_steps (the demo: --memory-every 1)"
)


def _memory_dir(node: Node) -> str:
    """The node's memory-tier directory: the one its supervisor created (``start`` event)."""
    start = next((e for e in node.events(fresh=True) if e["event"] == "start"), {})
    where = start.get("memory_tier")
    if not isinstance(where, str) or not where:
        raise RuntimeError(_NO_TIER)
    return where


def _slots(ctx: Ctx, node: str, rank: int) -> tuple[SlotStore, list[tuple[int, int]]]:
    """The victim's memory-tier slots (the directory its supervisor created) and the
    (step, slot) of each whose header verifies, newest first."""
    where = _memory_dir(ctx.node(node))
    if not os.path.isdir(os.path.join(where, f"rank-{rank}")):
        raise RuntimeError(_NO_TIER)
    store = SlotStore(where, rank)
    heads = [(h.step, i) for i in (0, 1) if (h := store.head(i)) is not None]
    return store, sorted(heads, reverse=True)


def _every(steps: list[int]) -> int:
    """K, from the two newest slots of one rank (newest first)."""
    return steps[0] - steps[1] if len(steps) > 1 else 1


def _memory_expectation(inj: Injection, heads: list[tuple[int, int]], ctx: Ctx) -> None:
    steps = ctx.committed()
    disk = steps[-1] if steps else None
    mem = heads[0][0] if heads else None
    inj.facts.update(
        memory_steps=[s for s, _ in heads],
        memory_every=_every([s for s, _ in heads]),
        disk_step=disk,
        tier="memory" if mem is not None and (disk is None or mem >= disk) else "disk",
    )
    inj.expected_restore = max((x for x in (mem, disk) if x is not None), default=None)


def _kill_memory(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    name, rank = _kill_one(spec, ctx, inj, since)
    _store, heads = _slots(ctx, name, rank)  # final: the publisher is dead
    _memory_expectation(inj, heads, ctx)


def _memory_damage(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    beats = ctx.wait_step(spec.step, since, ctx.world)
    procs = [(n, x) for n, bs in beats.items() for x in bs]
    for _, x in procs:  # frozen: nothing is published while we damage the newest slot
        _signal(x.pid, signal.SIGSTOP)
    name, b = _victim(beats, spec.victim)
    store, heads = _slots(ctx, name, b.rank)
    if not heads:
        for _, x in procs:
            _signal(x.pid, signal.SIGCONT)
        raise RuntimeError("no memory slot holds a step yet")
    step, slot = heads[0]
    path = store.slot_path(slot)
    payload = _size(path) - HEADER_BYTES
    at = HEADER_BYTES + spec.salt % max(1, payload)
    with open(path, "r+b") as f:  # bit rot in node memory
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << (spec.salt >> 20) % 8)]))
    for _, x in procs:
        _signal(x.pid, signal.SIGKILL)
    inj.record(
        name, b, f"flipped a bit of byte {at} of slot-{slot} (memory step {step}), then SIGKILL"
    )
    _wait_dead([x.pid for _, x in procs])
    inj.facts.update(damaged_step=step, damaged_slot=f"slot-{slot}")
    _memory_expectation(inj, heads[1:], ctx)


def _storage(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    beats = ctx.wait_step(spec.step, since, ctx.world)
    name, b = _victim(beats, 0)
    root = ctx.ckpt_root
    away = root + ".drill-away"
    os.rename(root, away)
    try:
        with open(root, "w") as f:  # a file where the directory was: nobody can write in it
            f.write("storage outage simulated by `unbroken drill`\n")
        inj.record(name, b, f"checkpoint directory replaced by a file at step {b.step}")
        inj.expected_restore = Store(away).steps()[-1] if Store(away).steps() else None
        node = ctx.node(name)
        fail = ctx.wait_failure(node, inj.t or 0.0)
        t_min = fail["t"] + ctx.outage

        def enough() -> list[dict[str, Any]] | None:
            bad = [
                e
                for e in node.events()
                if e["event"] == "preflight" and not e["ok"] and e["t"] > fail["t"]
            ]
            return bad if len(bad) >= 2 and time.time() >= t_min else None

        bad = ctx.wait(enough, "two failing pre-flights during the outage", interval=0.05)
        inj.facts.update(failing_preflights=len(bad), outage_from=fail["t"])
    finally:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(root)
        if os.path.isdir(away) and not os.path.exists(root):
            os.rename(away, root)
        inj.facts["outage_until"] = time.time()


def _agent_loss(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    beats = ctx.wait_step(spec.step, since, 2)
    live = sorted(n for n, bs in beats.items() if bs)
    name = live[spec.victim % len(live)]
    b = min(beats[name], key=lambda x: x.rank)
    agent = agent_of(b.pid)
    if agent is None:
        raise RuntimeError(
            f"could not find the torchrun agent of worker pid {b.pid} on node {name}"
        )
    before = ctx.committed()
    _signal(agent, signal.SIGKILL)
    inj.record(name, b, f"SIGKILL the torchrun agent of node {name} (pid {agent}) at step {b.step}")
    inj.facts.update(agent_pid=agent, report_node=name)
    # Its workers live on until the supervisor reaps them; they may save once more.
    inj.min_restore = before[-1] if before else None


def _world_size(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    beats = ctx.wait_step(spec.step, since, 2)
    # The node hosting the rendezvous store must survive: the store lives in its supervisor.
    victim = next((n for n in ctx.nodes if not n.hosting and n.running), None)
    if victim is None:
        raise RuntimeError("no running node that does not host the rendezvous store")
    host = next(n for n in ctx.nodes if n is not victim)
    before = ctx.committed()
    b = min(beats[victim.name] or beats[host.name], key=lambda x: x.rank)
    victim.kill()
    inj.record(
        victim.name,
        b,
        f"node {victim.name} lost (supervisor, agent and worker "
        f"SIGKILLed) at step {b.step}; {host.name} goes on alone",
    )
    inj.facts.update(report_node=host.name, lost_node=victim.name)
    inj.min_restore = before[-1] if before else None


def _held(where: str) -> tuple[list[int], list[int] | None]:
    """(steps of the node's own slots, steps of the peer replicas it keeps; None when it
    keeps no replica file at all): headers that verify, newest first."""

    def steps(paths: list[str]) -> list[int]:
        return sorted({h.step for p in paths if (h := slot_header(p)) is not None}, reverse=True)

    replicas = glob.glob(os.path.join(glob.escape(where), REPLICA_PREFIX + "*"))
    own = steps(glob.glob(os.path.join(glob.escape(where), "rank-*", "slot-*")))
    return own, steps(replicas) if replicas else None


def _removable(where: str) -> str:
    """``where`` when it is a memory directory ``unbroken run`` makes (a real directory of
    this user right under ``/dev/shm/unbroken-<uid>/``), which the drill removes with a
    lost node; else RuntimeError, before anything is killed."""
    path = os.path.abspath(where)
    why = ""
    if os.path.dirname(path) != memdir.user_root():
        why = f"not under {memdir.user_root()}"
    else:
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                why = "not a directory of this user (a symlink or another user's)"
        except OSError as e:
            why = f"unreadable ({e.strerror})"
    if why:
        raise RuntimeError(
            f"{where}: {why}: not a memory directory `unbroken run` made; the node is not "
            "lost and nothing is removed"
        )
    return path


def _replica_at_newest(where: str) -> int | None:
    """The step of a complete replica the node keeps for a peer at its own newest slot's
    step, else None."""
    own, replicas = _held(where)
    return own[0] if own and replicas and own[0] in replicas else None


def _freeze_at_a_replica(
    ctx: Ctx, victim: Node, holder: str, since: float, inj: Injection
) -> int | None:
    """SIGSTOP the victim node's workers at a moment the surviving node (memory directory
    ``holder``) keeps a complete replica of the victim's rank at the step of its own newest
    slot; that step, or None when the survivor keeps no replica file at all (the replica is
    off: nothing to wait for) or none became usable within 60 s (the victim stays frozen).

    Why wait: the replica has one slot (ckpt/replica.py), and a node lost while its round
    is in flight leaves no replica; a sender that fell behind can leave one older than both
    of the survivor's own slots: both fall back to the disk tier by design (ARCHITECTURE.md,
    "Known gap"), which is not what this fault proves, so it is injected at a moment it
    cannot hit that gap. Replica at
    the survivor's *newest* step: even if the survivor completes one more step after the
    freeze (the victim's part of it already sent), the replica's step stays in its slots.
    Only the workers are frozen: a frozen supervisor would stop its liveness ticks and the
    survivor's supervisor would declare the node lost (``--node-timeout``) before the kill.
    Remove the wait when the second replica slot lands (a node lost mid-round then still
    leaves the previous step's replica)."""
    end = time.monotonic() + 60.0
    inj.facts["freezes"] = 0
    while True:
        inj.facts["freezes"] += 1  # how often it took (the row's detail says it)
        beats = victim.live_beats(since)
        for b in beats:
            _signal(b.pid, signal.SIGSTOP)
        # a round in flight completes within this, or never while the victim is stopped
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            step = _replica_at_newest(holder)
            if step is not None:
                return step
            time.sleep(0.01)
        if _held(holder)[1] is None or time.monotonic() > end:
            return None
        seen = max((b.step for b in beats), default=0)
        for b in beats:
            _signal(b.pid, signal.SIGCONT)
        ctx.wait(
            functools.partial(_stepped, victim, since, seen),
            f"node {victim.name} to take one more step",
        )


def _stepped(node: Node, since: float, seen: int) -> bool:
    return any(b.step > seen for b in node.live_beats(since))


def _node_loss(spec: FaultSpec, ctx: Ctx, inj: Injection, since: float) -> None:
    """Node B lost whole with its memory (issue 25): a replacement node must restore its
    rank from the peer replica node A keeps, losing at most K steps."""
    beats = ctx.wait_step(spec.step, since, 2)
    # The node hosting the rendezvous store must survive: the store lives in its supervisor.
    victim = next((n for n in ctx.nodes if not n.hosting and n.running), None)
    if victim is None or not beats[victim.name] or ctx.start_node is None:
        raise RuntimeError("no running node that does not host the rendezvous store")
    host = next(n for n in ctx.nodes if n is not victim)
    lost, holder = _removable(_memory_dir(victim)), _memory_dir(host)
    step = _freeze_at_a_replica(ctx, victim, holder, since, inj)
    survivors = [x.pid for x in host.live_beats(since)]
    b = min(victim.live_beats(since) or beats[victim.name], key=lambda x: x.rank)
    victim.kill()  # SIGKILL: supervisor, agent, workers (frozen or not)
    try:  # ... and its /dev/shm goes with the node (its supervisor can no longer remove it)
        memdir.remove(lost)
        removed = "memory directory removed"
    except OSError as e:  # replaced since it was checked: left alone, said
        log.error("drill: %s", e)
        removed = f"memory directory NOT removed: {e}"
    inj.record(
        victim.name,
        b,
        f"node {victim.name} lost (supervisor, agent and worker SIGKILLed, {removed}) at "
        f"step {b.step}; node {host.name} kept a replica of its rank at step {step} "
        f"(workers frozen {inj.facts['freezes']} time(s) to find that moment)",
    )
    # The replacement starts at once (as a spare would); it takes seconds to come up and
    # join, and the job's restore only reads the survivor's copies before its first new
    # publish, so reading them once the survivor's worker died of the lost peer (its slots
    # are final then) sees what the restore sees.
    new = ctx.start_node(chr(ord(max(n.name for n in ctx.nodes)) + 1))
    ctx.nodes.append(new)
    _wait_dead(survivors, timeout=60.0)
    own, replicas = _held(holder)
    usable = sorted(set(own) & set(replicas or ()), reverse=True)
    disk = ctx.committed()
    inj.facts.update(
        report_node=host.name,
        lost_node=victim.name,
        memory_removed=lost,
        memory_steps=own,
        replica_steps=replicas,
        replica_step=usable[0] if usable else None,
        memory_every=_every(own),
        disk_step=disk[-1] if disk else None,
        tier="peer replica",
        replacement=new.name,
    )
    if usable:
        inj.expected_restore = usable[0]
    else:
        inj.min_restore = disk[-1] if disk else None


_INJECTORS: dict[str, Callable[[FaultSpec, Ctx, Injection, float], None]] = {
    "kill": _kill,
    "kill-in-save": _kill_in_save,
    "hang": _hang,
    "corrupt": _corrupt,
    "storage": _storage,
    "agent-loss": _agent_loss,
    "world-size": _world_size,
    "kill-memory": _kill_memory,
    "memory-damage": _memory_damage,
    "node-loss": _node_loss,
}


def inject(spec: FaultSpec, ctx: Ctx, since: float) -> Injection:
    """Wait for the fault's step (in an attempt launched after ``since``) and inject it.
    Never raises for a fault that could not be injected: the Injection says why."""
    inj = Injection(spec)
    try:
        _INJECTORS[spec.kind](spec, ctx, inj, since)
    except (TimeoutError, RuntimeError, OSError) as e:
        inj.error = f"{spec.kind} not injected: {e}"
        log.error("drill: %s", inj.error)
    return inj


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
