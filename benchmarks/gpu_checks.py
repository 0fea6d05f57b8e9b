"""All GPU checks in one prepared run, for a session that is lent the CUDA machine.

CI has no GPU, so every CUDA path of unbroken is otherwise unexercised. This script runs,
in one process and well inside the device budget (~3-5 minutes on an H200), in the order
1, 4, 3, 2 (the checkpoint check, which leaves the most memory behind, last):

1. **resume on CUDA** (DESIGN C-IDENTICAL, CUDA RNG restore): a transformer with dropout,
   fp16 autocast + GradScaler, AdamW + schedule, batches drawn from the CUDA RNG, trained
   N steps; the same training restored from the step-k checkpoint into a freshly built
   model (other seed) and continued must end bit-identical (weights, optimizer, scaler,
   loss at every step) - with deterministic algorithms on;
2. **checkpoint from GPU memory** (issue 6's GPU half): loop stall of
   ``Checkpointer(async_save=True).save`` vs the D2H floor (copy into preallocated pinned
   buffers), ``dcp.async_save`` + ``DefaultStager`` (pinned, async staging) and plain
   ``dcp.async_save``: every contender's first call is its warm-up (none pre-warmed), order
   rotated, DCP at unbroken's writer-thread count (issue 23); load back into GPU tensors,
   fully verified, vs ``dcp.load``, cold (files evicted) and warm (goal >= 4x);
3. **GPU feed** (issue 5): ``benchmarks/gpu_feed.py`` with its defaults - plain DataLoader,
   ``pin_memory``, ``DevicePrefetcher`` vs compute only (goal (c) <= 1.05x (d));
4. **pinned ring** (issue 16): ``StatefulLoader(pin_memory=True)`` over a packed image dataset
   decoded in 8 workers - every batch arrives pinned (ring slots registered with
   ``cudaHostRegister``), equal to the batches made without workers; non-blocking copies
   queued behind slow kernels from batches dropped right away still read the right bytes
   (a slot is recycled only after an event behind the copy); ``DevicePrefetcher``'s step
   over it vs a compute-only step (goal <= 1.05x; not judged when the ring alone is slower
   than the step), next to torch's pin-thread path; and once the persistent loaders are
   dropped mid-epoch, no slot left registered over unmapped memory.

Usage (repository root, on the GPU machine; the image's python3 has torch):
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_checks.py --json $OUT/gpu_checks.json
    .venv/bin/python benchmarks/gpu_checks.py --smoke     # tiny CPU run (CI runs this)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import unbroken  # noqa: F401
except ImportError:  # the GPU machine's python3 has torch, numpy, xxhash, fsspec; not us
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from ckpt_save_load import AsyncSaves, evict  # noqa: E402

from unbroken.ckpt import Checkpointer, TrainState  # noqa: E402
from unbroken.common.procs import maps_address  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn: Callable[[], Any], dev: torch.device) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


# --- 1. bit-identical resume on the device ---------------------------------------------------


class _Net(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


def _trainer(dev: torch.device, seed: int, size: dict[str, int]) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    model = _Net(size["vocab"], size["dim"], size["layers"]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=size["steps"])
    cuda = dev.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=cuda)
    state = TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    return state, model, opt, sched, scaler


def _train(
    parts: tuple[Any, ...],
    dev: torch.device,
    size: dict[str, int],
    until: int,
    ckpt: Checkpointer | None = None,
    save_at: int | None = None,
) -> list[float]:
    state, model, opt, sched, scaler = parts
    cuda = dev.type == "cuda"
    losses = []
    model.train()
    while state.step < until:
        # the batch comes from the device's RNG: a wrong CUDA RNG restore changes the data
        x = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=dev)
        with torch.autocast(dev.type, dtype=torch.float16, enabled=cuda):
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, size["vocab"]), x[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state.step += 1
        losses.append(float(loss.item()))
        if ckpt is not None and state.step == save_at:
            ckpt.save()
    return losses


def resume_check(dev: torch.device, root: str, smoke: bool) -> dict[str, Any]:
    size = (
        dict(vocab=64, dim=32, layers=1, batch=4, seq=17, steps=12)
        if smoke
        else dict(vocab=4096, dim=512, layers=4, batch=32, seq=257, steps=60)
    )
    k = size["steps"] // 3
    torch.use_deterministic_algorithms(True)
    try:
        ref = _trainer(dev, 0, size)
        ck = Checkpointer(os.path.join(root, "resume"), ref[0], keep_last=None)
        ref_losses = _train(ref, dev, size, size["steps"], ck, save_at=k)
        ck.close()
        other = _trainer(dev, 1234, size)  # other initial weights and RNG: restore must fix all
        torch.randn(1000, device=dev)  # move the device RNG on
        ck2 = Checkpointer(os.path.join(root, "resume"), other[0])
        got = ck2.restore(step=k)
        losses = _train(other, dev, size, size["steps"])
        ck2.close()
    finally:
        torch.use_deterministic_algorithms(False)
    ma, mb = ref[1].state_dict(), other[1].state_dict()
    weights = all(torch.equal(ma[n], mb[n]) for n in ma)
    oa, ob = ref[2].state_dict()["state"], other[2].state_dict()["state"]
    optim = all(torch.equal(oa[i][s], ob[i][s]) for i in oa for s in oa[i])
    scaler = ref[4].state_dict() == other[4].state_dict()
    curve = ref_losses[k:] == losses
    out = {
        "restored_step": got,
        "steps": size["steps"],
        "weights_identical": weights,
        "optimizer_identical": optim,
        "scaler_identical": scaler,
        "loss_curve_identical": curve,
    }
    out["identical"] = bool(got == k and weights and optim and scaler and curve)
    print(
        f"[1] resume on {dev.type}: restored step {got} of {size['steps']}; weights "
        f"{weights}, optimizer {optim}, scaler {scaler}, loss curve {curve} -> "
        f"{'BIT-IDENTICAL' if out['identical'] else 'DIFFERS'}",
        flush=True,
    )
    return out


# --- 2. checkpoint from device memory ----------------------------------------------------------


def big_state(dev: torch.device, gib: float) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """About ``gib`` GiB of training state on ``dev``: square fp32 layers (8192 wide from
    1 GiB, else 256) and AdamW's two moments, made by one step."""
    side = 8192 if gib >= 1 else 256
    n = max(1, round(gib * (1 << 30) / (3 * side * side * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(n)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def ckpt_check(dev: torch.device, root: str, gib: float, saves: int) -> dict[str, Any]:
    model, opt = big_state(dev, gib)
    # like for like (issue 23): no contender is pre-warmed; each one's first call is its
    # warm-up (shown, not in the median); the order rotates per round; DCP writes with
    # unbroken's writer-thread count; each save is finished before the next starts
    saver = AsyncSaves(model, opt, root, "D2H floor (pinned, preallocated)")
    try:
        rows = saver.run(saves, lambda fn: _timed(fn, dev))
    finally:
        saver.close()
    st, last = saver.st, saver.dcp_dirs
    nbytes = sum(t.numel() * t.element_size() for t in saver.flat if t.dim())
    floor_s = statistics.median(rows["D2H floor (pinned, preallocated)"][1:] or [float("nan")])
    print(
        f"[2] checkpoint of {nbytes / 2**30:.2f} GiB in {dev.type} memory, loop stall "
        f"per save (first = warm-up / median of the rest), x floor; order rotated:"
    )
    out: dict[str, Any] = {"bytes": nbytes, "stall": {}}
    for name, xs in rows.items():
        later = statistics.median(xs[1:]) if len(xs) > 1 else xs[0]
        out["stall"][name] = {"first": xs[0], "later": later, "x_floor": later / floor_s}
        print(f"    {name:<44} {xs[0]:8.3f} / {later:8.3f} s  {later / floor_s:6.2f}x")
    out["stager_renewed"] = saver.stager_renewed
    if saver.stager_renewed:
        print(
            f"    (DefaultStager made anew for {saver.stager_renewed} saves: this torch "
            "closed the caller's stager after each save)"
        )
    # load back into device tensors: cold (files evicted from the page cache), then warm
    target = {"model": model.state_dict(), "optim": opt.state_dict()}

    def ub_load() -> None:
        Checkpointer(os.path.join(root, "ub-async"), st).restore()

    def dcp_load() -> None:
        dcp.load(target, checkpoint_id=last[-1])

    saved = [t.clone() for t in saver.flat]  # every restore must bring back these bytes
    load: dict[str, float] = {}
    exact: dict[str, bool] = {}
    for name, fn, path in (("unbroken", ub_load, "ub-async"), ("dcp", dcp_load, last[-1])):
        for t in saver.flat:
            t.zero_()
        evict(os.path.join(root, path))
        load[f"{name}_cold"] = _timed(fn, dev)
        for t in saver.flat:
            t.zero_()
        load[f"{name}_warm"] = _timed(fn, dev)
        exact[name] = all(torch.equal(a, b) for a, b in zip(saver.flat, saved, strict=True))
    del saved
    out["load"] = {
        "unbroken_verified_s": load["unbroken_warm"],
        "dcp_load_s": load["dcp_warm"],
        "speedup": load["dcp_warm"] / load["unbroken_warm"],
        "unbroken_verified_cold_s": load["unbroken_cold"],
        "dcp_load_cold_s": load["dcp_cold"],
        "speedup_cold": load["dcp_cold"] / load["unbroken_cold"],
        "restored_exactly": exact,
        "h2d_gbps": _h2d_rates(dev, 2 << 30 if dev.type == "cuda" else 64 << 20),
    }
    print(
        f"    load into {dev.type}, warm: unbroken (verified) {load['unbroken_warm']:.3f} s, "
        f"dcp.load {load['dcp_warm']:.3f} s -> {out['load']['speedup']:.2f}x (goal >= 4x on "
        f"the GPU); cold: {load['unbroken_cold']:.3f} s vs {load['dcp_cold']:.3f} s -> "
        f"{out['load']['speedup_cold']:.2f}x; every byte restored: {exact}",
        flush=True,
    )
    rates = out["load"]["h2d_gbps"]
    print(
        "    host (pageable) -> device copy: "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()),
        flush=True,
    )
    out["after_restore"] = _first_save_after_restore(dev, os.path.join(root, "ub-async"), st)
    return out


def _first_save_after_restore(dev: torch.device, path: str, st: Any) -> dict[str, float]:
    """A resumed job that calls ``save()`` itself: the async restore allocates the snapshot
    buffers on the checkpoint thread right after it, so the first save's stall is the copy,
    not the pinned allocation (the 'first' column above, for a Checkpointer that saves right
    after it is built)."""
    ck = Checkpointer(path, st, async_save=True)
    try:
        restore_s = _timed(ck.restore, dev)
        ready_s = _timed(ck.wait, dev)  # the rest of the allocation, had the loop not waited
        step = (ck.latest() or 0) + 1
        first_s = _timed(lambda: ck.save(step), dev)
        ck.wait()
    finally:
        ck.close()
    print(
        f"    first async save after a restore: stall {first_s:.3f} s (restore {restore_s:.3f} s, "
        f"then buffers ready {ready_s:.3f} s later on the checkpoint thread)",
        flush=True,
    )
    return {"restore_s": restore_s, "buffers_ready_s": ready_s, "first_save_stall_s": first_s}


def _h2d_rates(dev: torch.device, nbytes: int) -> dict[str, float]:
    """The copy a restore makes into device tensors, alone: ``nbytes`` of pageable host
    memory (already touched) into a device tensor by ``Tensor.copy_`` and by the pinned
    ring restore uses (``tensor_io._copy_through_pinned``), best of 3 each."""
    from unbroken.ckpt.tensor_io import _copy_through_pinned

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ways = {
        "Tensor.copy_": lambda: dst.copy_(src),
        "pinned ring": lambda: _copy_through_pinned([(dst, src)], dev),
    }
    rates = {k: nbytes / min(_timed(fn, dev) for _ in range(3)) / 1e9 for k, fn in ways.items()}
    if not torch.equal(dst.cpu(), src):
        raise RuntimeError("the pinned ring did not copy every byte")
    return rates


# --- 4. the pinned shared-memory ring --------------------------------------------------------


def _decode_image(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    side = int(sample["side"])
    x = torch.frombuffer(bytearray(sample["img"]), dtype=torch.uint8).view(3, side, side)
    return x, int(sample["cls"])


def ring_check(dev: torch.device, root: str, smoke: bool) -> dict[str, Any]:
    from unbroken.data.prepare.pack import pack
    from unbroken.data.stream.dataset import StreamingDataset
    from unbroken.data.stream.loader import StatefulLoader

    side, n, batch, workers, steps = (16, 96, 8, 2, 6) if smoke else (96, 9216, 128, 8, 60)
    g = torch.Generator().manual_seed(0)
    data = os.path.join(root, "ring-data")
    pack(
        (
            {
                "__key__": f"{i:06d}",
                "side": str(side).encode(),
                "cls": str(i % 1000).encode(),
                "img": torch.randint(0, 256, (3 * side * side,), dtype=torch.uint8, generator=g)
                .numpy()
                .tobytes(),
            }
            for i in range(n)
        ),
        data,
        shard_size=16 << 20,
        fsync=False,
        progress=False,
    )
    ds = StreamingDataset(data, seed=0, transform=_decode_image)
    cuda = dev.type == "cuda"
    out: dict[str, Any] = {"samples": n, "batch": batch, "workers": workers}

    # (a) same batches as without workers, and pinned
    ref = list(StatefulLoader(ds, batch_size=batch, last_batch="drop"))
    ld = StatefulLoader(
        ds, batch_size=batch, last_batch="drop", num_workers=workers, pin_memory=True
    )
    same = pinned = 0
    for got, want in zip(ld, ref, strict=True):
        same += bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
        pinned += bool(cuda and got[0].is_pinned() and got[1].is_pinned())
    out.update(batches=len(ref), identical=same == len(ref), pinned=pinned)

    # (b) copies from dropped batches, queued behind slow kernels, still read the right bytes
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    busy = torch.randn(2048, 2048, device=dev) if cuda else None
    ld.set_epoch(0)  # the same epoch again
    for b in ld:
        if busy is not None:
            for _ in range(4):  # ~ms of work ahead of the copy on the same stream
                busy = torch.tanh(busy @ busy * 1e-3)
        copies.append((b[0].to(dev, non_blocking=True), b[1].to(dev, non_blocking=True)))
        del b  # the slot may be recycled now - but only once the copy has read it
    _sync(dev)
    intact = sum(
        bool(torch.equal(x.cpu(), w[0]) and torch.equal(y.cpu(), w[1]))
        for (x, y), w in zip(copies, ref, strict=True)
    )
    out["copies_intact"] = intact == len(ref)
    del copies

    # (c) DevicePrefetcher's step over the ring vs compute only (and torch's pin thread)
    out.update(_step_rows(dev, ds, ref[0], side, batch, workers, steps, smoke))
    rows, times, rounds = out["step_ms"], out["step_ms_rounds"], out["rounds"]
    floor = rows["compute only"]
    print(
        f"[4] pinned ring ({workers} workers, batch {batch}x3x{side}x{side} uint8): "
        f"{same}/{len(ref)} batches identical to the no-worker ones, {pinned} pinned on "
        f"arrival; copies from dropped batches intact: {out['copies_intact']}"
    )
    print(f"    median of {rounds} rounds, order rotated; ms/step of each round in brackets")
    for name, ms in rows.items():
        each = " / ".join(f"{t:.2f}" for t in times[name])
        print(f"    {name:<52} {ms:8.2f} ms/step  {ms / floor:6.3f}x  [{each}]")
    print(
        f"    ring slots registered {out['registrations']}, left registered over unmapped "
        f"memory after the loaders were dropped: {out['registrations_left_unmapped']}"
    )
    if cuda:
        pace = rows["the pinned ring alone (no compute: the data's pace)"]
        verdict = "PASS" if out["ratio"] <= 1.05 else "FAIL"
        if pace > floor:
            verdict += " (not judged: the workers alone are slower than the compute step)"
        print(f"    goal <= 1.05x compute only: {out['ratio']:.3f} -> {verdict}", flush=True)
    return out


def _step_rows(
    dev: torch.device,
    ds: Any,
    first: Any,
    side: int,
    batch: int,
    workers: int,
    steps: int,
    smoke: bool,
    rounds: int = 3,
) -> dict[str, Any]:
    """[4] (c): a training step fed by ``DevicePrefetcher`` over the pinned ring, the ring
    alone, and torch's pin thread, vs the step on a batch already on the device (``first``);
    rounds in rotated order, the median of each row."""
    from gpu_feed import TinyViT, make_normalise

    from unbroken.data.feed.prefetch import DevicePrefetcher
    from unbroken.data.stream.loader import StatefulLoader

    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = TinyViT(32 if smoke else 384, 1 if smoke else 6, 2 if smoke else 6, side).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    normalise = make_normalise(dev)

    def step(xy: Any) -> None:
        x, y = xy
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x), y.to(dev, non_blocking=True))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.item())  # one sync per step, as a logging loop does

    def fetch_only(xy: Any) -> None:
        float(xy[0][0, 0, 0, 0])  # one sync per step, as above: the batch has arrived

    def timed(source: Any, fn: Callable[[Any], None] = step) -> float:
        it = iter(source)
        for _ in range(5):
            fn(next(it))
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            fn(next(it))
        return (time.perf_counter() - t0) / steps * 1e3

    loaders: list[StatefulLoader] = []

    def epochs(**kw: Any) -> Any:
        loader = StatefulLoader(
            ds,
            batch_size=batch,
            last_batch="drop",
            num_workers=workers,
            pin_memory=True,
            persistent_workers=True,
            **kw,
        )
        loaders.append(loader)
        for e in range(1000):
            loader.set_epoch(e)
            yield from loader

    fixed = normalise(tuple(t.to(dev) for t in first))
    sources: dict[str, Callable[[], tuple[Any, Callable[[Any], None]]]] = {
        "compute only": lambda: (iter(lambda: fixed, None), step),
        "the pinned ring alone (no compute: the data's pace)": lambda: (
            DevicePrefetcher(epochs(), device=dev, transform=normalise),
            fetch_only,
        ),
        "DevicePrefetcher over the pinned ring": lambda: (
            DevicePrefetcher(epochs(), device=dev, transform=normalise),
            step,
        ),
        "DevicePrefetcher over torch's pin thread": lambda: (
            DevicePrefetcher(epochs(shm_transport=False), device=dev, transform=normalise),
            step,
        ),
    }
    names, times = list(sources), {name: [] for name in sources}
    registered, left = 0, 0
    for r in range(rounds):  # order rotated per round; the median of each row
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(*sources[name]()))
            got = _drop_loaders(loaders, dev)
            registered, left = registered + got[0], left + got[1]
    rows = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "step_ms": rows,
        "step_ms_rounds": times,
        "rounds": rounds,
        "ratio": rows["DevicePrefetcher over the pinned ring"] / rows["compute only"],
        "registrations": registered,
        "registrations_left_unmapped": left,
    }


def _drop_loaders(loaders: list[Any], dev: torch.device) -> tuple[int, int]:
    """Drop persistent loaders mid-epoch, as a loop that stops early drops them: no CUDA
    registration of a ring slot may outlive its mapping (a later pinned allocation at that
    address fails: "resource already mapped"). -> (slots registered, left over unmapped)."""
    rings = [r for ld in loaders if ld._rx is not None for r in ld._rx._rings.values()]
    ptrs = [p for ring in rings for p in ring.registered.values()]
    del rings, loaders[:]
    gc.collect()
    _sync(dev)
    return len(ptrs), sum(_still_registered(p) and not maps_address(p) for p in ptrs)


def _still_registered(ptr: int) -> bool:
    """Whether CUDA still counts host address ``ptr`` as pinned (cudaPointerGetAttributes,
    through ``is_pinned``; the bytes are never read)."""
    if not torch.cuda.is_available():
        return False
    one = np.frombuffer((ctypes.c_char * 1).from_address(ptr), np.uint8)
    return torch.from_numpy(one).is_pinned()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8.0, help="checkpoint state size on the GPU")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--skip", default="", help="comma list of resume,ckpt,feed,ring to skip")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run to check the script")
    a = p.parse_args(argv)
    if a.smoke:
        dev, a.gib, a.saves = torch.device("cpu"), 0.01, 2
    elif not torch.cuda.is_available():
        print("gpu_checks: no CUDA device; --smoke checks the script on CPU", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    skip = set(filter(None, a.skip.split(",")))
    root = tempfile.mkdtemp(prefix="ub-gpu-", dir=a.dir)
    out: dict[str, Any] = {"device": str(dev), "smoke": a.smoke}
    # The checkpoint check last: it leaves tens of GiB of pinned host memory cached by torch
    # and its files in the scratch directory; DataLoader workers forked after it (8 in each
    # of [4] and [3]) got the process OOM-killed on the 125 GiB machine.
    try:
        if "resume" not in skip:
            out["resume"] = resume_check(dev, root, a.smoke)
        if "ring" not in skip:
            out["ring"] = ring_check(dev, root, a.smoke)
        if "feed" not in skip:
            import gpu_feed

            print("[3] GPU feed (benchmarks/gpu_feed.py):", flush=True)
            feed_json = os.path.join(root, "feed.json")
            rc = gpu_feed.main((["--smoke"] if a.smoke else []) + ["--json", feed_json])
            with open(feed_json) as f:
                out["feed"] = {"rc": rc, **json.load(f)}
        if "ckpt" not in skip:
            out["ckpt"] = ckpt_check(dev, root, a.gib, a.saves)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    ring = out.get("ring", {})
    ok = (
        out.get("resume", {}).get("identical", True)
        and ring.get("identical", True)
        and ring.get("copies_intact", True)
        and not ring.get("registrations_left_unmapped", 0)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
