"""Checkpoint save/load: unbroken's Checkpointer vs torch.save/torch.load and DCP, same run.

    .venv/bin/python benchmarks/ckpt_save_load.py --gib 2 --repeats 3

State: an MLP of 4096x4096 float32 layers plus its AdamW moments (~``--gib`` GiB in all).
Every contender writes the same state to the same disk; medians of ``--repeats`` rounds,
run interleaved so drift in disk or CPU speed hits every contender alike.

* save: blocking time until the call returns. Checkpointer and dcp.save fsync their files
  (Checkpointer also computes xxh3 checksums and per-tensor stats and commits atomically);
  torch.save does not fsync (as people use it).
* load: Checkpointer.restore() (verifies every checksum and statistic, then applies the
  state to the live model and optimizer) vs dcp.load into preallocated tensors (no
  verification) vs torch.load. Files are in the page cache, as after a crash on the same
  node.
* ceiling: ``dd if=/dev/zero bs=64M conv=fsync`` write bandwidth, same size.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from unbroken.ckpt import Checkpointer, TrainState

warnings.filterwarnings("ignore", message="torch.distributed is")


def make_state(gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layer_bytes = 4096 * 4096 * 4
    n = max(1, round(gib * (1 << 30) / (3 * layer_bytes)))
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
    return n


def dd_bandwidth(path: str, nbytes: int) -> float:
    count = max(1, nbytes // (64 << 20))
    out = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "conv=fsync"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    os.unlink(path)
    secs = float(re.search(r"copied, ([0-9.]+) s", out).group(1))  # type: ignore[union-attr]
    return count * (64 << 20) / secs


def raw_write(path: str, tensors: list[torch.Tensor]) -> None:
    """The same bytes straight from memory to one file, then fsync: the disk's ceiling for
    this state (no serialisation, no checksum)."""
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(memoryview(t.numpy()).cast("B"))
        os.fsync(f.fileno())


def timed(fn) -> float:  # noqa: ANN001 - called at once, so late binding of loop vars is fine
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def stall_table(model: torch.nn.Module, opt: torch.optim.Optimizer, root: str, saves: int) -> None:
    """Training-loop stall per checkpoint, repeated saves (the first one allocates)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    nbytes = state_bytes(model, opt)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    flat = [t for t in _tensors(sd)]
    bufs = [torch.empty_like(t, pin_memory=cuda) for t in flat]
    out: dict[str, list[float]] = {}

    def rec(name: str, secs: float) -> None:
        out.setdefault(name, []).append(secs)

    st = TrainState(model=model, optimizer=opt)
    ck = Checkpointer(os.path.join(root, "ub-async"), st, async_save=True, keep_last=1)
    # The loop's first step boundary (maybe_save, no save due): the checkpoint thread
    # allocates the snapshot buffers while training goes on; a real loop trains for
    # every_steps steps before the first save, here we just wait for it (not timed).
    ck.maybe_save()
    ck.wait()
    stager = DefaultStager(StagingOptions(cuda, not cuda, cuda, cuda))
    for i in range(saves):
        rec(
            "memcpy floor (copy into preallocated buffers)",
            timed(lambda: [b.copy_(t) for b, t in zip(bufs, flat, strict=True)]),
        )
        st.step = i
        rec("unbroken Checkpointer(async_save=True).save", timed(lambda: ck.save()))
        ck.wait()
        rec("torch.save", timed(lambda: torch.save(sd, os.path.join(root, "t.pt"))))
        rec("dcp.save", timed(lambda: dcp.save(sd, checkpoint_id=os.path.join(root, f"dcp{i}"))))
        fut: list = []
        rec(
            "dcp.async_save",
            timed(
                lambda: fut.append(dcp.async_save(sd, checkpoint_id=os.path.join(root, f"dcpa{i}")))
            ),
        )
        fut[0].result()
        fut.clear()
        rec(
            "dcp.async_save + DefaultStager",
            timed(
                lambda: fut.append(
                    dcp.async_save(
                        sd, checkpoint_id=os.path.join(root, f"dcps{i}"), async_stager=stager
                    )
                )
            ),
        )
        r = fut[0]
        (r.upload_completion if hasattr(r, "upload_completion") else r).result()
        for d in (f"dcp{i}", f"dcpa{i}", f"dcps{i}"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    ck.close()
    stager.close()
    floor = statistics.median(out["memcpy floor (copy into preallocated buffers)"][1:])
    print()
    print(
        f"| loop stall per checkpoint ({nbytes / 2**30:.2f} GiB, {'CUDA' if cuda else 'CPU'}) | first save (s) | later saves, median (s) | vs memcpy floor |"
    )
    print("|---|---|---|---|")
    for name, v in out.items():
        later = statistics.median(v[1:]) if len(v) > 1 else v[0]
        print(f"| {name} | {v[0]:.3f} | {later:.3f} | {later / floor:.2f}x |")


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to test")
    ap.add_argument(
        "--stall",
        type=int,
        default=0,
        metavar="N",
        help="also measure loop stall over N repeated async saves",
    )
    a = ap.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="ub-bench-", dir=os.environ.get("TMPDIR", "/tmp"))
    model, opt = make_state(a.gib)
    nbytes = state_bytes(model, opt)
    print(
        f"state: {nbytes / 2**30:.2f} GiB, torch {torch.__version__}, threads {torch.get_num_threads()}, dir {root}"
    )
    res: dict[str, list[float]] = {
        k: []
        for k in (
            "ckpt_save",
            "ckpt_load",
            "dcp_save",
            "dcp_load",
            "torch_save",
            "torch_load",
            "dd",
            "raw",
        )
    }
    for r in range(a.repeats):
        # --- saves ---
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        st = TrainState(model=model, optimizer=opt)
        st.step = r
        ck = Checkpointer(os.path.join(root, "ub"), st, keep_last=1)
        res["ckpt_save"].append(timed(lambda: ck.save()))
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        res["dcp_save"].append(timed(lambda: dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))))
        res["torch_save"].append(timed(lambda: torch.save(sd, os.path.join(root, "t.pt"))))
        res["dd"].append(nbytes / dd_bandwidth(os.path.join(root, "dd.bin"), nbytes))
        res["raw"].append(timed(lambda: raw_write(os.path.join(root, "raw.bin"), _tensors(sd))))
        os.unlink(os.path.join(root, "raw.bin"))
        # --- loads (page-cached) ---
        st2 = TrainState(model=model, optimizer=opt)
        res["ckpt_load"].append(
            timed(lambda: Checkpointer(os.path.join(root, "ub"), st2).restore())
        )
        target = {"model": model.state_dict(), "optim": opt.state_dict()}
        res["dcp_load"].append(
            timed(lambda: dcp.load(target, checkpoint_id=os.path.join(root, "dcp")))
        )
        res["torch_load"].append(
            timed(lambda: torch.load(os.path.join(root, "t.pt"), weights_only=True))
        )
        print(
            f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in res.items()), flush=True
        )
    med = {k: statistics.median(v) for k, v in res.items()}
    gb = nbytes / 1e9
    print()
    print(
        f"| operation ({nbytes / 2**30:.2f} GiB, median of {a.repeats}) | seconds | GB/s | vs unbroken |"
    )
    print("|---|---|---|---|")
    for k, label in (
        ("ckpt_save", "unbroken Checkpointer.save (fsync + xxh3 + stats + atomic commit)"),
        ("dcp_save", "dcp.save (fsync)"),
        ("torch_save", "torch.save (no fsync)"),
        ("dd", "dd bs=64M conv=fsync (write ceiling)"),
        ("raw", "raw write + fsync of the same bytes (write ceiling)"),
        ("ckpt_load", "unbroken Checkpointer.restore (verify all + apply)"),
        ("dcp_load", "dcp.load (no verification)"),
        ("torch_load", "torch.load"),
    ):
        base = med["ckpt_save"] if "save" in k or k in ("dd", "raw") else med["ckpt_load"]
        print(f"| {label} | {med[k]:.2f} | {gb / med[k]:.2f} | {med[k] / base:.2f}x |")
    print()
    print(f"save bandwidth vs dd ceiling: {med['dd'] / med['ckpt_save'] * 100:.0f}% (goal >= 85%)")
    print(f"save bandwidth vs raw write+fsync: {med['raw'] / med['ckpt_save'] * 100:.0f}%")
    print(f"load speed-up vs dcp.load: {med['dcp_load'] / med['ckpt_load']:.2f}x (goal >= 2x)")
    if a.stall:
        stall_table(model, opt, root, a.stall)
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
