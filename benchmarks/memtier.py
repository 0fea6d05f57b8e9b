"""The memory tier (issue 25): what it costs the loop, how fast it restores, what memory it
takes.

    flock /tmp/unbroken-bench.lock .venv/bin/python benchmarks/memtier.py \
        --gib 2 --repeats 3 --json memtier.json

1. Demo model at K = 1: the demo's TinyGPT (vocab 96, ctx 32, batch 16, AdamW, one thread)
   trained in rotating blocks of ``--block`` steps with a Checkpointer without triggers
   (tier off), with ``memory_every_steps=1, async_save=True`` (tier on), and with the
   floor (each step only copies the state's tensors into a tmpfs slot mapping and hashes
   it: what any K = 1 publish costs the loop); the median of the per-block ratios (load
   drifts slower than a round of blocks). Overhead = on / off - 1, floor = floor / off - 1.
2. A ``--gib`` GiB state (4096x4096 float32 layers + AdamW moments, as
   benchmarks/ckpt_save_load.py): per publish, what the loop waits for (the snapshot copy:
   ``last_blocked_seconds``: since issue 25 speed item 3, the copy of the live tensors
   straight into the slot) next to the async disk save's stall of the same state, and the
   background part (the slot's xxh3 and header, in the tier's thread). K = 1 costs the loop
   the stall plus whatever of the background part a step does not hide (the next publish
   waits for it).
3. Restore of that state: from the memory tier (``restore()`` picks the slot: header
   all-gather, xxh3 of the payload, fit, rehearse, copy) vs a warm restore from the disk
   tier (files in the page cache; ``restore()`` with the tier off), same state, medians.
4. Memory: the slot files of the rank (2 x state + headers) against the state, and the
   snapshot buffers the async save already holds.

The load average is printed (the box is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt_save_load import evict, make_state, state_bytes

from unbroken.ckpt import Checkpointer, TrainState
from unbroken.ckpt.memtier import _Mapped
from unbroken.ckpt.save import encode
from unbroken.demo.model import TinyGPT

warnings.filterwarnings("ignore", message="torch.distributed is")


def _shm(tmp: str) -> str:
    """Where the tier's slots go: tmpfs as in a job (``/dev/shm/unbroken-<uid>``, the
    default), not the disk under ``tmp``: a shared mapping of a disk file is written back
    (before issue 25 item 2's run the demo part measured a tier on the disk)."""
    if os.path.exists("/dev/shm"):
        return os.path.join("/dev/shm", f"unbroken-{os.geteuid()}")
    return os.path.join(tmp, "unbroken-bench")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- 1. the demo model at K = 1 ------------------------------------------------------------


def demo_overhead(blocks: int, block: int, tmp: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(96, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    st = TrainState(model=model, optimizer=opt)
    x = torch.randint(0, 96, (16, 32))
    off = Checkpointer(os.path.join(tmp, "off"), st, async_save=True)
    on = Checkpointer(
        os.path.join(tmp, "on"),
        st,
        async_save=True,
        memory_every_steps=1,
        memory_dir=os.path.join(_shm(tmp), "bench-memtier-demo"),
    )

    cpu: dict[int, float] = {}

    def run(ck: Checkpointer | _Floor) -> float:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(block):
            model(x, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            st.step += 1
            ck.maybe_save()
        ck.wait()  # the last publish counts against its block
        cpu[id(ck)] = (time.thread_time() - c0) / block  # this thread's CPU: less load noise
        return (time.perf_counter() - t0) / block

    run(on), run(off)  # warm-up: buffers, slots, allocator
    floor = _Floor(st, os.path.join(_shm(tmp), "bench-memtier-floor"))
    run(floor)
    ratios, t_off, t_on, cpu_ratios, floor_ratios, floor_cpu = [], [], [], [], [], []
    arms: list[Checkpointer | _Floor] = [off, on, floor]
    for i in range(blocks):
        took = {}
        for ck in arms[i % 3 :] + arms[: i % 3]:  # the order rotates
            took[id(ck)] = run(ck)
        t_off.append(took[id(off)])
        t_on.append(took[id(on)])
        ratios.append(took[id(on)] / took[id(off)])
        cpu_ratios.append(cpu[id(on)] / cpu[id(off)])
        floor_ratios.append(took[id(floor)] / took[id(off)])
        floor_cpu.append(cpu[id(floor)] / cpu[id(off)])
    assert on._memory is not None
    slot_bytes = sum(
        os.path.getsize(on._memory.store.slot_path(i))
        for i in range(2)
        if os.path.exists(on._memory.store.slot_path(i))
    )
    stall = on.last_blocked_seconds or 0.0
    planned = getattr(on._memory, "planned", 0)  # (0 before the plan existed)
    on.close()
    off.close()
    for name in ("bench-memtier-floor", "bench-memtier-demo"):
        shutil.rmtree(os.path.join(_shm(tmp), name), ignore_errors=True)
    return {
        "step_off_ms": statistics.median(t_off) * 1e3,
        "step_on_ms": statistics.median(t_on) * 1e3,
        "overhead_pct": (statistics.median(ratios) - 1) * 100,
        "cpu_overhead_pct": (statistics.median(cpu_ratios) - 1) * 100,
        "floor_pct": (statistics.median(floor_ratios) - 1) * 100,
        "floor_cpu_pct": (statistics.median(floor_cpu) - 1) * 100,
        "planned": planned,
        "stall_ms": stall * 1e3,
        "slot_bytes": slot_bytes,
        "state_bytes": state_bytes(model, opt),
        "blocks": blocks,
        "block": block,
    }


class _Floor:
    """What any K = 1 publish must do in the loop, and nothing else: copy the state's
    tensors into a slot mapping on the tier's file system and hash it (two mappings, in
    turn); no state_dict, no JSON, no header."""

    def __init__(self, st: TrainState, directory: str) -> None:
        live = encode(st)[3]
        sig = tuple((k, t.dtype, t.shape) for k, t in live.items())
        self.srcs = [t for t in live.values() if t.numel()]
        os.makedirs(directory, mode=0o700, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
        self.maps = [
            _Mapped(os.open(os.path.join(directory, f"slot-{i}"), flags, 0o600), sig, 0)
            for i in range(2)
        ]
        self.i = 0

    def maybe_save(self) -> None:
        self.i ^= 1
        m = self.maps[self.i]
        with torch.no_grad():
            torch._foreach_copy_(m.views, self.srcs)
        m.digest()

    def wait(self) -> None:
        pass


# --- 2-4. a large state ------------------------------------------------------------------


def big_state(gib: float, repeats: int, tmp: str) -> dict[str, Any]:
    model, opt = make_state(gib)
    st = TrainState(model=model, optimizer=opt, capture_rng=False)
    nbytes = state_bytes(model, opt)
    tier = os.path.join(_shm(tmp), "bench-memtier")
    root = os.path.join(tmp, "ckpt")
    out: dict[str, Any] = {"state_bytes": nbytes, "tier_dir": tier}

    # the async disk save's stall vs the memory publish's (the same snapshot copy)
    disk = Checkpointer(root, st, async_save=True, keep_last=1)
    stalls, writes = [], []
    for _ in range(repeats + 1):
        st.step += 1
        disk.save()
        stalls.append(disk.last_blocked_seconds or 0.0)
        disk.wait()
        writes.append(disk.last_save_seconds or 0.0)
    disk.close()
    out["disk_stalls_s"] = [round(x, 3) for x in stalls]  # the first: buffers allocated
    out["disk_stall_s"] = statistics.median(stalls[1:])
    out["disk_write_s"] = statistics.median(writes[1:])

    mem = Checkpointer(root, st, async_save=True, memory_every_steps=1, memory_dir=tier)
    assert mem._memory is not None
    mem._lock.take(mem)
    pub_stall, pub_bg = [], []
    for _ in range(repeats + 1):
        st.step += 1
        mem._publish(mem._memory, st.step)
        pub_stall.append(mem.last_blocked_seconds or 0.0)
        t0 = time.perf_counter()
        mem.wait()
        pub_bg.append(time.perf_counter() - t0)
    out["publish_stalls_s"] = [round(x, 3) for x in pub_stall]  # the first: slot 0 created
    out["publish_stall_s"] = statistics.median(pub_stall[1:])
    out["publish_background_s"] = statistics.median(pub_bg[1:])
    out["slot_bytes"] = sum(os.path.getsize(mem._memory.store.slot_path(i)) for i in range(2))
    out["snapshot_buffer_bytes"] = mem._snap.allocated_bytes
    # disk catches up with the memory tier: both hold the newest step, same state
    st.step += 1
    mem.save()
    mem.wait()
    mem._memory.store.close()  # as after a crash: the slots stay
    mem._lock.release()
    step = st.step

    r = _restores(st, root, tier, step, repeats)
    out["restore_memory_s"], out["restore_disk_warm_s"] = r["memory"], r["warm"]
    out["restore_disk_cold_s"] = r["cold"]
    out["restore_speedup"] = r["warm"] / r["memory"]
    shutil.rmtree(tier, ignore_errors=True)
    return out


def _restore_once(st: TrainState, root: str, tier: str | None, step: int) -> float:
    kw: dict[str, Any] = {"memory_every_steps": 1, "memory_dir": tier} if tier else {}
    ck = Checkpointer(root, st, **kw)
    got = ck.restore()
    want = "memory" if tier else "disk"
    if got != step or ck.restored_tier != want:
        raise RuntimeError(f"restored {got} from {ck.restored_tier}, wanted {step} from {want}")
    if ck._memory is not None:  # leave the slots for the next round
        ck._memory.store.close()
        if ck._memory_done is not None:
            ck._memory_done.detach()
    ck._lock.release()
    return ck.last_restore_seconds or 0.0


def _restores(st: TrainState, root: str, tier: str, step: int, repeats: int) -> dict[str, float]:
    """Median seconds of restore() from memory, from the warm disk tier (files in the page
    cache) and from the cold disk tier (evicted first), order alternating."""
    times: dict[str, list[float]] = {"memory": [], "warm": [], "cold": []}
    for i in range(repeats + 1):
        order = ["memory", "warm"] if i % 2 == 0 else ["warm", "memory"]
        for kind in order:
            t = _restore_once(st, root, tier if kind == "memory" else None, step)
            if i:  # the first round warms both (page cache, allocator)
                times[kind].append(t)
        if i:
            evict(root)
            times["cold"].append(_restore_once(st, root, None, step))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--tmp", default=None, help="disk directory for the checkpoints")
    p.add_argument("--only", choices=["demo", "big"], default=None, help="run one part")
    a = p.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="unbroken-memtier-", dir=a.tmp)
    res: dict[str, Any] = {"load_before": _load()}
    try:
        if a.only != "big":
            res["demo"] = demo_overhead(a.blocks, a.block, tmp)
            print(f"load {_load()}; demo K=1: {json.dumps(res['demo'])}", flush=True)
        if a.only != "demo":
            res["big"] = big_state(a.gib, a.repeats, tmp)
            print(f"load {_load()}; {a.gib} GiB: {json.dumps(res['big'])}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_after"] = _load()
    _summary(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def _summary(res: dict[str, Any]) -> None:
    if "demo" in res:
        d = res["demo"]
        print(
            f"\ndemo model, K=1: step {d['step_off_ms']:.2f} ms off, {d['step_on_ms']:.2f} ms "
            f"on: overhead {d['overhead_pct']:+.1f}% wall, {d['cpu_overhead_pct']:+.1f}% CPU (goal <= 2%); "
            f"stall {d['stall_ms']:.2f} ms; the floor (copy + hash only) "
            f"{d['floor_pct']:+.1f}% wall, {d['floor_cpu_pct']:+.1f}% CPU; planned publishes "
            f"{d['planned']}"
        )
    if "big" in res:
        b = res["big"]
        print(
            f"{b['state_bytes'] / 2**30:.2f} GiB state: publish stall {b['publish_stall_s']:.3f} s vs "
            f"async disk stall {b['disk_stall_s']:.3f} s; publish in background "
            f"{b['publish_background_s']:.3f} s "
            f"({b['state_bytes'] / b['publish_background_s'] / 1e9:.2f} GB/s); disk write "
            f"{b['disk_write_s']:.2f} s\n"
            f"each publish's stall {b['publish_stalls_s']} s, each async save's "
            f"{b['disk_stalls_s']} s\n"
            f"restore: memory {b['restore_memory_s']:.3f} s vs warm disk "
            f"{b['restore_disk_warm_s']:.3f} s: {b['restore_speedup']:.1f}x (goal >= 5x); cold "
            f"disk {b['restore_disk_cold_s']:.3f} s\n"
            f"memory per rank: slots {b['slot_bytes'] / 2**30:.2f} GiB "
            f"({b['slot_bytes'] / b['state_bytes']:.2f}x the state) + snapshot buffers "
            f"{b['snapshot_buffer_bytes'] / 2**30:.2f} GiB"
        )
    print(f"load average before {res['load_before']}, after {res['load_after']}")


if __name__ == "__main__":
    main()
