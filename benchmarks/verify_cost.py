"""What verifying every sample on read costs: StreamingDataset(verify=True) vs verify=False.

Side by side in the same process and the same run, alternating on/off for every repeat (so
load drifts hit both alike), on data of benchmarks/data_read.py's recipe (2-6 KB random bytes +
a small JSON per sample, 64 MB tar shards) and on uint16 token shards:

1. ``read``: the worker's own cost, ``StreamingDataset.read`` of whole shuffled batches in
   this process (no DataLoader), in samples per CPU second - the worst case for the ratio,
   nothing else dilutes it; a batch of 256 takes ~64 samples from each of 4 shards.
   ``read-64``: batches of 64 (data_read.py's batch size: ~16 samples per shard group).
   ``read-1mb``: the same samples in 1 MB shards, so a batch takes 1-2 samples from each of
   ~200 shards (verification works per shard group: its fixed cost weighs more);
2. ``loader``: ``StatefulLoader`` with 2 workers, the per-sample ``touch`` function and list
   collate of data_read.py - the read throughput a training loop sees (wall clock), and the
   CPU time per delivered sample of main process + workers (``loader-cpu``: what decides the
   throughput on a box whose cores are all busy, and robust to other jobs' load);
3. ``tokens``: ``StreamingDataset.read`` of seq_len 1024 batches of 16 from token shards,
   in tokens per CPU second, one fresh dataset per epoch, so every 64 Ki-token block is
   verified once (when first touched) inside the measurement; ``tokens2``: the second epoch
   of the same dataset (every block already verified by this reader).

Prints one JSON line per measurement and a table of medians with on/off ratios.

    PYTHONPATH=src python benchmarks/verify_cost.py [--root DIR] [--samples N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Any

import numpy as np

ROOT = "/tmp/unbroken-bench-verify"
BATCH = 256
SEQ_LEN = 1024
TOK_BATCH = 16
TOKENS = 32 << 20


def make_sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng([7, i])
    size = int(rng.integers(2048, 6145))
    meta = json.dumps({"i": i, "label": i % 1000, "size": size}).encode()
    return {"__key__": f"{i:08d}", "bin": rng.bytes(size), "json": meta}


def prepare(root: str, n: int) -> None:
    from unbroken.data.manifest import DatasetManifest
    from unbroken.data.prepare.pack import pack
    from unbroken.data.tokens.shard import TokenShardWriter

    done = os.path.join(root, f"ready-{n}-2")
    if os.path.exists(done):
        return
    pack((make_sample(i) for i in range(n)), f"{root}/tar", shard_size=64 << 20, progress=False)
    pack((make_sample(i) for i in range(n)), f"{root}/tar1m", shard_size=1 << 20, progress=False)
    out = f"{root}/tokens"
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(3)
    infos = []
    for s in range(2):
        name = f"tokens-{s:06d}.bin"
        w = TokenShardWriter(f"{out}/{name}", "uint16", 0, fsync=False)
        while w.num_tokens < TOKENS // 2:
            w.add(rng.integers(1, 50_000, int(rng.integers(200, 2000)), dtype=np.uint16))
        infos.append(w.commit_info(SEQ_LEN))
    DatasetManifest.create("tokens", infos, dtype="uint16", eos_id=0, seq_len=SEQ_LEN).save(out)
    open(done, "w").close()


def touch(sample: dict[str, Any]) -> tuple[str, bytes]:
    return sample["__key__"], bytes(sample["bin"])


def list_collate(batch: list[Any]) -> list[Any]:
    return list(batch)


def time_read(root: str, verify: bool, batch: int, seed: int, warm: bool = False) -> float:
    """Samples per CPU second of StreamingDataset.read over one whole shuffled epoch, in
    this process (CPU time, not wall time: on a shared box other jobs' load moves wall time
    by 2x between repeats, CPU time by a few percent)."""
    from unbroken.data.stream.dataset import StreamingDataset

    ds = StreamingDataset(root, seed=seed, verify=verify)
    n = ds.epoch_length
    for epoch in (0, 1) if warm else (0,):  # warm: time the second epoch only
        t0 = time.process_time()
        for a in range(0, n, batch):
            ds.read(epoch, np.arange(a, min(a + batch, n)))
    return n / (time.process_time() - t0)


def _cpu() -> float:
    """CPU seconds of this process and of its finished (joined) children, user + system."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def time_loader(root: str, verify: bool, seed: int) -> tuple[float, float]:
    """Steady-state samples/s (after 10 batches) of a 2-worker StatefulLoader epoch, and the
    CPU microseconds per delivered sample of the whole epoch (main + both workers; the
    workers are joined at the epoch end, so their time is in RUSAGE_CHILDREN)."""
    from unbroken.data.stream.dataset import StreamingDataset
    from unbroken.data.stream.loader import StatefulLoader

    ds = StreamingDataset(root, seed=seed, verify=verify, transform=touch)
    ld = StatefulLoader(ds, batch_size=BATCH, collate_fn=list_collate, num_workers=2)
    n, t0, n0 = 0, 0.0, 0
    c0 = _cpu()
    for b, out in enumerate(ld):
        if b == 10:
            t0, n0 = time.perf_counter(), n
        n += len(out)
    t1 = time.perf_counter()
    return (n - n0) / (t1 - t0), (_cpu() - c0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--samples", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--only",
        nargs="*",
        default=["read", "read-64", "read-1mb", "loader", "tokens", "tokens2"],
    )
    a = ap.parse_args()
    prepare(a.root, a.samples)
    tar, tok = f"{a.root}/tar", f"{a.root}/tokens"
    runs: dict[tuple[str, bool], list[float]] = {}

    def loader(v: bool, r: int) -> dict[str, float]:
        rate, cpu = time_loader(tar, v, r)
        return {"loader": rate, "loader-cpu": cpu}

    kinds: dict[str, Any] = {
        "read": lambda v, r: {"read": time_read(tar, v, BATCH, r)},
        "read-64": lambda v, r: {"read-64": time_read(tar, v, 64, r)},
        "read-1mb": lambda v, r: {"read-1mb": time_read(f"{a.root}/tar1m", v, BATCH, r)},
        "loader": loader,
        "tokens": lambda v, r: {"tokens": time_read(tok, v, TOK_BATCH, r) * SEQ_LEN},
        "tokens2": lambda v, r: {"tokens2": time_read(tok, v, TOK_BATCH, r, True) * SEQ_LEN},
    }
    units = {
        "read": "samples/CPU-s",
        "read-64": "samples/CPU-s",
        "read-1mb": "samples/CPU-s",
        "loader": "samples/s",
        "loader-cpu": "CPU us/sample",
        "tokens": "tokens/CPU-s",
        "tokens2": "tokens/CPU-s",
    }
    print(f"load before: {os.getloadavg()[0]:.1f} (1 min), cpus: {os.cpu_count()}", flush=True)
    for kind in a.only:
        kinds[kind](True, 99)  # warm the page cache and imports
        for r in range(a.repeats):
            for verify in (r % 2 == 0, r % 2 == 1):  # alternate which goes first
                got = kinds[kind](verify, r)
                for k, v in got.items():
                    runs.setdefault((k, verify), []).append(v)
                print(json.dumps({"verify": verify, "repeat": r, **got}), flush=True)
    print(f"\nload after: {os.getloadavg()[0]:.1f} (1 min), cpus: {os.cpu_count()}")
    print(f"{'measure':<11} {'unit':<14} {'verify off':>12} {'verify on':>12} {'on/off':>8}")
    for k, unit in units.items():
        if (k, False) not in runs:
            continue
        off = statistics.median(runs[(k, False)])
        on = statistics.median(runs[(k, True)])
        print(f"{k:<11} {unit:<14} {off:>12,.1f} {on:>12,.1f} {on / off:>8.3f}")


if __name__ == "__main__":
    main()
