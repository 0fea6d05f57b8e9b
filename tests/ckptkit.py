"""Checkpoint builders and damage tools for the checkpoint trust tests: a small two-checkpoint
root with the exact state of each step, manifest edits an attacker would make (checksums
recomputed), and a tiny pickle assembler for crafted ``.metadata`` payloads.

A plain module, not a conftest (see datakit.py)."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import pickle
import shutil
import struct
import subprocess
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from rankkit import group_file, join_group
from unbroken.ckpt import Checkpointer, TrainState
from unbroken.common.fs import checksum_bytes

STEPS = (2, 4)


class Blob:
    """The smallest Stateful: one value under ``t``."""

    def __init__(self, t: Any) -> None:
        self.t = t

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = sd["t"]


def can_mount() -> bool:
    """Root with mount(8): real tmpfs mounts (tiny disks, read-only roots) are possible."""
    return (
        os.geteuid() == 0
        and subprocess.run(["which", "mount"], capture_output=True).returncode == 0
    )


@contextlib.contextmanager
def tmpfs(path: str, size: str = "16m") -> Iterator[str]:
    """A real tmpfs of ``size`` mounted at ``path`` for the duration."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def small_state(
    seed: int = 0, **kw: Any
) -> tuple[TrainState, torch.nn.Sequential, torch.optim.Optimizer]:
    """Model, AdamW, StepLR (and whatever further ``TrainState`` arguments ``kw`` holds)."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    return TrainState(model=m, optimizer=opt, scheduler=sched, **kw), m, opt


def train(st: TrainState, m: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        m(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        st.components["scheduler"].step()
        st.step += 1


def snapshot(st: TrainState) -> dict[str, Any]:
    """Every tensor, number and RNG state of the live state, owned (for bit-identity)."""
    sd = st.state_dict()

    def own(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, np.ndarray):
            return x.copy()
        if isinstance(x, dict):
            return {k: own(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(own(v) for v in x)
        return x

    return own(sd)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def identical(a: Any, b: Any) -> bool:
    """Bit-identical: same structure, same tensor dtypes/shapes/bytes, same scalars."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bytes(a), _bytes(b))
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(identical, a, b))
    return type(a) is type(b) and a == b


def build_root(root: str, **kw: Any) -> dict[int, dict[str, Any]]:
    """Steps 2 and 4 of a small run (model, AdamW, StepLR, and whatever further
    ``TrainState`` arguments ``kw`` holds); the exact state of each."""
    st, m, opt = small_state(**kw)
    ck = Checkpointer(root, st, keep_last=None)
    want: dict[int, dict[str, Any]] = {}
    for s in STEPS:
        train(st, m, opt, s - st.step)
        ck.save()
        want[s] = snapshot(st)
    ck.close()
    return want


def _ranked_saver(rank: int, root: str, store: str, want: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    join_group(rank, 2, store)
    try:
        h = Blob(torch.zeros(5))
        st, m, opt = small_state(extras={"h": h})
        ck = Checkpointer(root, st, keep_last=None)
        states: dict[int, dict[str, Any]] = {}
        for s in STEPS:
            train(st, m, opt, s - st.step)  # same seed, same batches: the model stays equal
            h.t = torch.arange(5.0) + 100 * rank + s  # differs: saved per rank
            ck.save()
            states[s] = snapshot(st)
        ck.close()
        if rank == 0:
            with open(want, "wb") as f:
                pickle.dump(states, f)
    finally:
        dist.destroy_process_group()


def build_ranked_root(root: str) -> dict[int, dict[str, Any]]:
    """Steps 2 and 4 saved by 2 gloo ranks (forked): model, AdamW, StepLR equal on both,
    ``extra.h`` different (saved per rank, ``rank<r>/`` keys). Returns rank 0's state of
    each step (restored at world size 1, rank 0 takes rank 0's copy)."""
    work = os.path.dirname(os.path.abspath(root))
    store, want = group_file(work), os.path.join(work, "rank0-states.pkl")
    ctx = mp.get_context("fork")  # no re-import of torch: ~1 s for both ranks
    procs = [ctx.Process(target=_ranked_saver, args=(r, root, store, want)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        for p in procs:
            p.kill()
        raise RuntimeError(f"2-rank save failed: exit codes {codes}")
    with open(want, "rb") as f:
        return pickle.load(f)  # our own file, just written


def spawn_two(worker: Callable[..., None], job: dict[str, Any]) -> None:
    """Run ``worker(rank, 2, job)`` on two spawned ranks (fresh interpreters), ``job`` given
    ``rdzv``, a fresh rendezvous file under ``job["out"]`` (``rankkit.join_group``)."""
    import torch.multiprocessing as tmp_mp

    job = {**job, "rdzv": group_file(job["out"])}
    tmp_mp.start_processes(worker, args=(2, job), nprocs=2, start_method="spawn", join=True)


class Pristine:
    """A run a module fixture made once at ``place``, put back as it was for each test
    (:meth:`fresh`): each test damages the files as it likes, and the ranks' spawn (~3
    CPU-seconds each) is paid once per module. Put back at the same path, not copied
    elsewhere: a memory-tier slot names the realpath of its checkpoint root, and a slot of
    another root is rightly never used."""

    def __init__(self, place: str) -> None:
        self.place = place
        self._copy = place.rstrip("/") + ".pristine"
        shutil.copytree(place, self._copy, symlinks=True)

    def fresh(self) -> str:
        """``place`` as the fixture left it (file contents, modes and times)."""
        shutil.rmtree(self.place)
        shutil.copytree(self._copy, self.place, symlinks=True)
        return self.place


def report_and_exit(job: dict[str, Any], rank: int, out: dict[str, Any]) -> None:
    """A spawned rank's last act: ``out`` to ``<job out>/<mode>-<rank>.json``, a barrier,
    and an exit with no close() (the memory tier's slots stay, as after a crash)."""
    import torch.distributed as dist

    with open(os.path.join(job["out"], f"{job['mode']}-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def data_files(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".distcp"))


def read_manifest(d: str) -> dict[str, Any]:
    with open(os.path.join(d, "manifest.json"), "rb") as f:
        return json.loads(f.read())


def write_manifest(d: str, m: dict[str, Any], *, resign: bool = True) -> None:
    """Write ``m`` as ``d``'s manifest; ``resign`` recomputes its self-checksum the way an
    attacker would (when the format has one)."""
    if resign and "manifest_checksum" in m:
        from unbroken.ckpt.manifest import manifest_digest

        m["manifest_checksum"] = manifest_digest(m)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write(json.dumps(m, indent=1))


def edit_manifest(d: str, edit: Callable[[dict[str, Any]], object], *, resign: bool = True) -> None:
    m = read_manifest(d)
    edit(m)
    write_manifest(d, m, resign=resign)


def replace_file(d: str, name: str, data: bytes) -> None:
    """Replace ``d/name`` and record its new size and checksum in the manifest (re-signed)."""
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    edit_manifest(
        d,
        lambda m: m["files"].__setitem__(
            name, {"size": len(data), "checksum": checksum_bytes(data)}
        ),
    )


def flip(path: str, at: int, mask: int = 0x10) -> None:
    """Bit rot in place: XOR byte ``at`` of ``path`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def demo_run(d: str, steps: int, args: list[str]) -> str:
    """One uninterrupted run of the demo training script in ``d`` (a reference run)."""
    from unbroken.demo import run_training

    rc, _ = run_training(d, steps, 0, args)
    assert rc == 0, open(os.path.join(d, "train.log")).read()
    return d


def assert_same_run(reference: str, d: str) -> None:
    """C-IDENTICAL: run ``d`` ended where ``reference`` ended, bit for bit, with the same
    loss curve and samples and no step logged twice."""
    from unbroken.ckpt.compare import compare_runs

    res = compare_runs(reference, d)
    for part in ("model", "optimizer", "scheduler", "ema", "loader"):
        assert res[part] == [], f"{part} differs after resume: {res[part][:3]}"
    assert res["first_loss_diff"] is None and res["first_sample_diff"] is None
    assert res["duplicated_steps"] == 0 and res["identical"]


def read_state(d: str, name: str = "state-rank0.json") -> dict[str, Any]:
    """A rank's state file as JSON: ``{"state": <encoded tree>, "rng": <encoded RNG>}``."""
    with open(os.path.join(d, name), "rb") as f:
        return json.loads(f.read())


def edit_state(
    d: str, edit: Callable[[dict[str, Any]], object], name: str = "state-rank0.json"
) -> None:
    """Edit a rank's state file and record its new size and checksum (re-signed): content
    that decodes, checked only by what restore makes of it."""
    blob = read_state(d, name)
    edit(blob)
    replace_file(d, name, json.dumps(blob).encode())


def root_bytes(root: str) -> int:
    """What the files under ``root`` hold, in bytes (the B of the memory bound 2·B + 256 MiB)."""
    return sum(
        os.lstat(os.path.join(dp, n)).st_size for dp, _, names in os.walk(root) for n in names
    )


def tensor_blob(t: torch.Tensor, pkl: bytes) -> bytes:
    """A ``torch.save`` blob of ``t`` whose ``data.pkl`` is ``pkl``."""
    buf = io.BytesIO()
    torch.save(t, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else zin.read(info)
            zout.writestr(info.filename, data)
    return out.getvalue()


def replace_blob(d: str, key: str, blob: bytes) -> None:
    """Put ``blob`` in place of tensor ``key``'s item in its data file; every offset, size
    and checksum in the manifest updated (re-signed), as an attacker would."""
    m = read_manifest(d)
    chunk = m["tensors"][key]["chunks"][0]
    name = chunk["file"]
    with open(os.path.join(d, name), "rb") as f:
        data = f.read()
    start, end = chunk["offset"], chunk["offset"] + chunk["length"]
    new = data[:start] + blob + data[end:]
    delta = len(blob) - chunk["length"]
    for t in m["tensors"].values():
        for c in t["chunks"]:
            if c["file"] == name and c["offset"] > start:
                c["offset"] += delta
    chunk["length"] = len(blob)
    m["files"][name] = {"size": len(new), "checksum": checksum_bytes(new)}
    with open(os.path.join(d, name), "wb") as f:
        f.write(new)
    edit_manifest(d, lambda x: x.update(m))


def vm_status(key: str) -> int:
    """``/proc/self/status``'s ``key`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def restore_here(root: str) -> tuple[int | None, dict[str, Any], int]:
    """``restore()`` of ``small_state(seed=9)`` from ``root`` in this process: the restored
    step, a snapshot of the live state, and the peak RSS (bytes) the restore added
    (``/proc/self/clear_refs`` resets the peak; :func:`peak_rss` measures in a fresh one)."""
    st, _, _ = small_state(seed=9)
    ck = Checkpointer(root, st)
    base = vm_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    try:
        got = ck.restore()
        peak = vm_status("VmHWM") - base
    finally:
        ck.close()
    return got, snapshot(st), peak


_PEAK_CHILD = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
from ckptkit import small_state
from unbroken.ckpt import Checkpointer
from unbroken.ckpt.export import verify_steps

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

st, _, _ = small_state(seed=9)
out = {}
for mode in sys.argv[2].split(","):
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    if mode == "restore":
        ck = Checkpointer(sys.argv[1], st, allow_fresh_start=True)
        try:
            got = ck.restore()
        finally:
            ck.close()
    else:
        got = [v.step for v in verify_steps(sys.argv[1], progress=False) if v.ok]
    out[mode] = {"extra": status("VmHWM") - base, "result": got}
print(json.dumps(out))
"""


def peak_rss(root: str, modes: str = "verify,restore", timeout: float = 300) -> dict[str, Any]:
    """Peak RSS beyond the process's RSS before the call (bytes), and the result, of
    ``ckpt verify`` (the intact steps) and ``restore()`` (the step) on ``root``, each
    measured in a fresh Python process (``/proc/self/clear_refs`` resets the peak)."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))  # ckptkit, for the child's import
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, root, modes],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"peak_rss child exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def copy_root(src: str, dst: str) -> None:
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=True)


# --- a pickle assembler for crafted payloads ---------------------------------------------------


def p_str(s: str) -> bytes:
    """SHORT_BINUNICODE / BINUNICODE."""
    b = s.encode()
    return (b"\x8c" + bytes([len(b)]) if len(b) < 256 else b"X" + struct.pack("<I", len(b))) + b


def p_global(module: str, name: str) -> bytes:
    """Protocol-0 GLOBAL opcode."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def p_stack_global(module: str, name: str) -> bytes:
    return p_str(module) + p_str(name) + b"\x93"


def p_call(fn: bytes, *args: str) -> bytes:
    """``fn(*args)`` through REDUCE; ``fn`` is the bytes that push the callable."""
    return fn + b"(" + b"".join(p_str(a) for a in args) + b"tR"


def p_long_binput(index: int) -> bytes:
    """LONG_BINPUT: store the top of the stack in memo slot ``index``."""
    return b"r" + struct.pack("<I", index)


PROTO = b"\x80\x04"
STOP = b"."
