"""Read throughput and resume latency: unbroken's StreamingDataset vs the anchors.

Same run, same 100,000 samples (2-6 KB random bytes + a small JSON each, ~400 MB), each
loader on its own format of them (our tar shards are also what WebDataset reads; MosaicML
Streaming reads MDS, LitData its optimized chunks; 64 MB shards/chunks everywhere), 2 DataLoader
workers, shuffle on, the same per-sample function (`touch`: keep the key and the payload bytes)
and the same list collate for every loader:

1. steady-state samples/s (after the first 10 batches, to the end of one epoch), seeds 0/1/2,
   with two shuffle-quality numbers of the delivered order (Spearman index-vs-position, share
   of consecutive samples within 1,000 indexes of each other), a "ceiling" row: the same fn
   and collate over samples already in memory, through torch's stock worker->main transport
   (the bound for any loader that uses that transport), and "unbroken-pipe": ours with that
   stock transport (shm_transport=False) instead of its shared-memory ring;
2. resume: time from constructing a fresh loader with a state saved at 90% of the epoch (by a
   real run) to its first batch; ours also at 10% and 50% (flatness), with num_workers=0, and
   the start-up of a bare 2-worker DataLoader for reference;
3. tokens/s from token shards at seq_len 1024 vs nanoGPT's `get_batch` over one np.memmap.

The data follows benchmarks/data_prep.py's recipe (sizes, JSON, keys, 64 MB shards) and is
generated once under --root (default /tmp/unbroken-bench-read; ~1.7 GB in all formats).

Every measurement runs in a fresh subprocess of the same interpreter. Run from the anchor
venv (built by benchmarks/_anchor_env.sh):

    .venv-bench/bin/python benchmarks/data_read.py            # full run
    .venv-bench/bin/python benchmarks/data_read.py --only unbroken webdataset
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

ROOT = "/tmp/unbroken-bench-read"
N = 100_000
BATCH = 256
WORKERS = 2
SHARD = 64 << 20
LOADERS = ("unbroken", "webdataset", "mosaicml", "litdata", "ceiling", "unbroken-pipe")
OURS = ("unbroken", "unbroken-pipe", "ceiling")  # not anchors
# litdata-bd1: LitData with batch_decode=1 (decode only the requested row), the workaround for
# its seed-dependent slow-down (see RESULTS.md); run with --only litdata litdata-bd1
EXTRA = ("litdata-bd1",)
SEQ_LEN = 1024
TOK_BATCH = 16
TOKENS = 64 << 20  # 64 Mi tokens (uint16): 128 MB


# --- the data ----------------------------------------------------------------------------


def make_sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng([7, i])
    size = int(rng.integers(2048, 6145))
    meta = json.dumps({"i": i, "label": i % 1000, "size": size}).encode()
    return {"__key__": f"{i:08d}", "bin": rng.bytes(size), "json": meta}


def _litdata_item(i: int) -> dict[str, Any]:
    s = make_sample(i)
    return {"key": s["__key__"], "bin": s["bin"], "json": s["json"]}


def prepare(root: str, n: int) -> None:
    os.makedirs(root, exist_ok=True)
    done = os.path.join(root, f"ready-{n}")
    if os.path.exists(done):
        return
    t0 = time.perf_counter()
    from unbroken.data.pack import pack

    pack((make_sample(i) for i in range(n)), f"{root}/tar", shard_size=SHARD, progress=False)
    from streaming import MDSWriter

    cols = {"key": "str", "bin": "bytes", "json": "bytes"}
    with MDSWriter(out=f"{root}/mds", columns=cols, size_limit=SHARD) as w:
        for i in range(n):
            w.write(_litdata_item(i))
    import litdata

    litdata.optimize(
        fn=_litdata_item,
        inputs=list(range(n)),
        output_dir=f"{root}/litdata",
        chunk_bytes=SHARD,
        num_workers=1,
        verbose=False,
    )
    _prepare_tokens(root)
    open(done, "w").close()
    print(f"prepared {root} in {time.perf_counter() - t0:.0f} s", flush=True)


def _prepare_tokens(root: str) -> None:
    """Token shards (ours) and the same tokens as one flat file (nanoGPT's train.bin)."""
    from unbroken._fs import checksum_bytes
    from unbroken.data.manifest import DatasetManifest, ShardInfo
    from unbroken.data.tokens import TokenShardWriter, num_sequences

    out = f"{root}/tokens"
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(3)
    flat = open(f"{root}/train.bin", "wb")
    infos = []
    per_shard = TOKENS // 4
    for s in range(4):
        name = f"tokens-{s:06d}.bin"
        w = TokenShardWriter(f"{out}/{name}", "uint16", 0, fsync=False)
        while w.num_tokens < per_shard:
            w.add(rng.integers(1, 50_000, int(rng.integers(200, 2000)), dtype=np.uint16))
        size, digest, raw = w.commit()
        with open(f"{out}/{name}", "rb") as f:
            flat.write(f.read())
        infos.append(
            ShardInfo(
                name,
                num_sequences(w.num_tokens, SEQ_LEN),
                size,
                digest,
                name + ".idx",
                len(raw),
                checksum_bytes(raw),
                w.num_documents,
                w.num_tokens,
            )
        )
    flat.close()
    DatasetManifest.create("tokens", infos, dtype="uint16", eos_id=0, seq_len=SEQ_LEN).save(out)


# --- the same per-sample function and collate for every loader -------------------------


def touch(sample: dict[str, Any]) -> tuple[str, bytes]:
    # bytes(): LitData hands out memoryviews, which cannot cross the worker queue
    key = sample["__key__"] if "__key__" in sample else sample["key"]
    return key, bytes(sample["bin"])


def list_collate(batch: list[Any]) -> list[Any]:
    return list(batch)


# --- loaders -------------------------------------------------------------------------------


def make_loader(name: str, root: str, seed: int, state: Any = None, workers: int = WORKERS) -> Any:
    if name in ("unbroken", "unbroken-pipe"):
        from unbroken.data.dataset import StreamingDataset
        from unbroken.data.loader import StatefulLoader

        ds = StreamingDataset(f"{root}/tar", seed=seed, transform=touch)
        ld = StatefulLoader(
            ds,
            BATCH,
            collate_fn=list_collate,
            num_workers=workers,
            shm_transport=name == "unbroken",
        )
        if state is not None:
            ld.load_state_dict(state)
        return ld
    if name == "webdataset":
        import webdataset as wds

        urls = sorted(f"{root}/tar/{f}" for f in os.listdir(f"{root}/tar") if f.endswith(".tar"))
        pipe = (
            wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False)
            .shuffle(1000, seed=seed)
            .map(touch)
            .batched(BATCH, collation_fn=list_collate, partial=True)
        )
        return wds.WebLoader(pipe, batch_size=None, num_workers=WORKERS)
    if name == "mosaicml":
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()

        class _Touched(StreamingDataset):
            def __getitem__(self, i: Any) -> Any:
                return touch(super().__getitem__(i))

        ds = _Touched(local=f"{root}/mds", shuffle=True, shuffle_seed=seed, batch_size=BATCH)
        ld = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=list_collate)
        if state is not None:
            ld.load_state_dict(state)
        return ld
    if name in ("litdata", "litdata-bd1"):
        from litdata import StreamingDataLoader, StreamingDataset

        extra = {"batch_decode": 1} if name == "litdata-bd1" else {}
        ds = StreamingDataset(f"{root}/litdata", shuffle=True, seed=seed, transform=touch, **extra)
        ld = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=list_collate)
        if state is not None:
            ld.load_state_dict(state)
        return ld
    if name == "ceiling":
        # No storage at all: the samples are built in memory before the workers fork, so this
        # measures fn, collate and torch's stock worker->main transport (pickle through a
        # pipe), which every anchor uses; unbroken's ring transport is not bound by it.
        from torch.utils.data import DataLoader

        return DataLoader(
            _InMemory(N), batch_size=None, num_workers=WORKERS, collate_fn=list_collate
        )
    raise ValueError(f"unknown loader {name!r}; one of {LOADERS + EXTRA}")


class _InMemory(IterableDataset):
    """Pre-built samples split into batches round-robin over workers (an IterableDataset)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.samples = [
            {"__key__": f"{i:08d}", "bin": rng.bytes(int(rng.integers(2048, 6145)))}
            for i in range(n)
        ]

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        order = np.random.default_rng(1).permutation(len(self.samples))
        for b in range(wid, -(-len(order) // BATCH), nw):
            yield list_collate([touch(self.samples[i]) for i in order[b * BATCH : (b + 1) * BATCH]])


def child_read(name: str, root: str, seed: int) -> dict[str, Any]:
    ld = make_loader(name, root, seed)
    seen: list[list[str]] = []
    n = 0
    t_start = time.perf_counter()
    t0 = None
    for b, batch in enumerate(ld):
        if b == 10:
            t0, n0 = time.perf_counter(), n
        n += len(batch)
        seen.append([k for k, _ in batch])
    t1 = time.perf_counter()
    if t0 is None:
        raise RuntimeError(f"{name}: fewer than 10 batches")
    order = np.array([int(k) for keys in seen for k in keys], dtype=np.int64)
    return {
        "samples_per_s": (n - n0) / (t1 - t0),
        "samples": n,
        "distinct": len(set(order.tolist())),
        "epoch_s": t1 - t_start,
        **shuffle_quality(order),
    }


def shuffle_quality(order: np.ndarray) -> dict[str, float]:
    """Of the delivered order (sample index at each position): Spearman correlation of index
    and position, and the share of consecutive pairs whose indexes lie within 1,000 of each
    other (same ~4 MB region of the data; 2% for a uniform random permutation of 100k)."""
    n = order.size
    rank = np.empty(n, dtype=np.float64)
    rank[np.argsort(order, kind="stable")] = np.arange(n)
    pos = np.arange(n, dtype=np.float64)
    spearman = float(np.corrcoef(rank, pos)[0, 1])
    near = float((np.abs(np.diff(order)) < 1000).mean())
    return {"spearman": spearman, "near_pairs": near}


def child_state(name: str, root: str, frac: float, path: str) -> dict[str, Any]:
    """Run a real loader to ``frac`` of the epoch and save its state."""
    ld = make_loader(name, root, 0)
    stop = int(frac * N / BATCH)
    for b, _ in enumerate(ld):
        if b + 1 == stop:
            break
    with open(path, "wb") as f:
        pickle.dump(ld.state_dict(), f)
    return {"batches": stop}


def _time_first_batch(name: str, root: str, state: Any, workers: int = WORKERS) -> float:
    t0 = time.perf_counter()
    ld = make_loader(name, root, 0, state, workers=workers)
    it = iter(ld)
    next(it)
    dt = time.perf_counter() - t0
    del it, ld
    return dt


def child_resume(name: str, root: str, path: str) -> dict[str, Any]:
    """Median of 5 fresh loaders from a state saved by a real run at 90% of the epoch; ours
    also at 10% and 50% (the state is a position, so any position is a valid state),
    interleaved, and with num_workers=0 (our own cost, without DataLoader worker start-up)."""
    with open(path, "rb") as f:
        state = pickle.load(f)
    _warm_imports(name)
    fracs = (0.1, 0.5, 0.9) if name == "unbroken" else (0.9,)
    res: dict[str, Any] = {}
    for workers in (WORKERS, 0) if name == "unbroken" else (WORKERS,):
        times: dict[float, list[float]] = {f: [] for f in fracs}
        for _ in range(5):
            for f in fracs:
                st = {**state, "samples_consumed": int(f * N)} if name == "unbroken" else state
                times[f].append(_time_first_batch(name, root, st, workers))
        for f in fracs:
            res[f"{int(f * 100)}%/{workers}w"] = statistics.median(times[f])
    if name == "unbroken":
        # the floor under any loader here: torch starting 2 workers for a 1-item dataset
        from torch.utils.data import DataLoader

        bare = []
        for _ in range(5):
            t0 = time.perf_counter()
            it = iter(DataLoader(_One(), batch_size=None, num_workers=WORKERS))
            next(it)
            bare.append(time.perf_counter() - t0)
            del it
        res["bare_dataloader"] = statistics.median(bare)
    return res


class _One(IterableDataset):
    def __iter__(self) -> Any:
        yield [0]


def _warm_imports(name: str) -> None:
    """Import the loader's modules before the clock starts: resume time is not import time."""
    if name == "unbroken":
        import unbroken.data.loader  # noqa: F401
    elif name == "mosaicml":
        import streaming  # noqa: F401
    elif name.startswith("litdata"):
        import litdata  # noqa: F401


def child_tokens(name: str, root: str, seconds: float = 6.0) -> dict[str, Any]:
    import torch

    if name == "nanogpt":
        # nanoGPT train.py get_batch (CPU branch), memmap re-created per batch as there
        def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
            data = np.memmap(f"{root}/train.bin", dtype=np.uint16, mode="r")
            ix = torch.randint(len(data) - SEQ_LEN, (TOK_BATCH,))
            x = torch.stack([torch.from_numpy(data[i : i + SEQ_LEN].astype(np.int64)) for i in ix])
            y = torch.stack(
                [torch.from_numpy(data[i + 1 : i + 1 + SEQ_LEN].astype(np.int64)) for i in ix]
            )
            return x, y

        for _ in range(10):
            get_batch()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            x, y = get_batch()
            n += x.numel()
        return {"tokens_per_s": n / (time.perf_counter() - t0)}
    from torch.utils.data import default_collate

    from unbroken.data.dataset import StreamingDataset
    from unbroken.data.loader import StatefulLoader

    # "unbroken": the default (rows stacked in the worker, one buffer through the pipe);
    # "unbroken-shm": collate_fn=default_collate (a shared-memory tensor per batch)
    collate = default_collate if name == "unbroken-shm" else None
    ds = StreamingDataset(f"{root}/tokens", seed=0)
    ld = StatefulLoader(ds, TOK_BATCH, collate_fn=collate, num_workers=WORKERS)
    n = 0
    t0 = None
    for b, batch in enumerate(ld):
        x, _y = batch[:, :-1], batch[:, 1:]
        if b == 10:
            t0 = time.perf_counter()
        elif t0 is not None:
            n += x.numel()
            if time.perf_counter() - t0 > seconds:
                break
    if t0 is None:
        raise RuntimeError("fewer than 10 token batches")
    return {"tokens_per_s": n / (time.perf_counter() - t0)}


def child_litexplain(root: str, seed: int) -> dict[str, Any]:
    """Why LitData's speed depends on the seed: where its chunk split between the workers
    falls, how many rows its decoder decodes per delivered item, and the workers' CPU time."""
    import resource

    import torch.utils.data._utils.worker as wk
    from litdata import StreamingDataset
    from litdata.streaming import item_loader as il
    from litdata.utilities.env import _DistributedEnv

    ds = StreamingDataset(f"{root}/litdata", shuffle=True, seed=seed)
    shuffler = ds._create_shuffler(ds._create_cache(worker_env=None))
    _, intervals = shuffler.get_chunks_and_intervals_per_workers(
        _DistributedEnv(1, 0, 1), WORKERS, BATCH, 1
    )
    # [chunk_start, read_start, read_end, chunk_end]: a worker that starts reading a chunk at an
    # offset not divisible by the 256-row decode window
    misaligned = sum(int(iv[2] - iv[1]) for w in intervals for iv in w if (iv[1] - iv[0]) % 256)
    rows = {"n": 0}
    orig = il.PyTreeLoader._batch_deserialize_payload

    def counting(self: Any, view: Any, offsets: Any, chunk: int, start: int, end: int) -> Any:
        rows["n"] += end - start
        return orig(self, view, offsets, chunk, start, end)

    il.PyTreeLoader._batch_deserialize_payload = counting  # type: ignore[method-assign]
    items = 0
    for w in range(WORKERS):  # each worker's share, iterated here as that worker would

        class _Info:
            id = w
            num_workers = WORKERS
            seed = 0
            dataset = None

        wk._worker_info = _Info()  # type: ignore[assignment]
        try:
            items += sum(1 for _ in StreamingDataset(f"{root}/litdata", shuffle=True, seed=seed))
        finally:
            wk._worker_info = None
    il.PyTreeLoader._batch_deserialize_payload = orig  # type: ignore[method-assign]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    read = child_read("litdata", root, seed)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "intervals": [[[int(x) for x in iv] for iv in w] for w in intervals],
        "misaligned_items": misaligned,
        "rows_decoded_per_item": rows["n"] / max(1, items),
        "worker_cpu_s": cpu,
        "samples_per_s": read["samples_per_s"],
    }


# --- driver --------------------------------------------------------------------------------


def _run_child(*args: str, timeout: float = 900) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", default=list(LOADERS), choices=LOADERS + EXTRA)
    ap.add_argument("--skip-tokens", action="store_true")
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument(
        "--explain-litdata", action="store_true", help="only: why LitData's speed swings by seed"
    )
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "read":
            res = child_read(rest[0], a.root, int(rest[1]))
        elif kind == "state":
            res = child_state(rest[0], a.root, float(rest[1]), rest[2])
        elif kind == "resume":
            res = child_resume(rest[0], a.root, rest[1])
        elif kind == "litexplain":
            res = child_litexplain(a.root, int(rest[0]))
        else:
            res = child_tokens(rest[0], a.root)
        print("RESULT " + json.dumps(res), flush=True)
        return

    prepare(a.root, N)
    if a.explain_litdata:
        for seed in a.seeds:
            r = _run_child("litexplain", str(seed))
            print(
                f"litdata seed {seed}: {r['samples_per_s']:8.0f} samples/s, worker CPU "
                f"{r['worker_cpu_s']:.2f} s/epoch, {r['rows_decoded_per_item']:.1f} rows decoded "
                f"per item, {r['misaligned_items']} items in worker intervals misaligned to the "
                f"256-row decode window; intervals {r['intervals']}",
                flush=True,
            )
        return
    print(
        f"data: {N} samples, {BATCH}/batch, {WORKERS} workers, shuffle on, fn=touch, "
        f"collate=list; cpus={os.cpu_count()}",
        flush=True,
    )
    speed: dict[str, list[float]] = {}
    quality: dict[str, list[float]] = {}
    for seed in a.seeds:  # loaders interleaved: a change in machine load hits all alike
        for name in a.only:
            r = _run_child("read", name, str(seed))
            speed.setdefault(name, []).append(r["samples_per_s"])
            quality.setdefault(name, []).append(r["near_pairs"])
            print(
                f"  read {name:10s} seed {seed}: {r['samples_per_s']:9.0f} samples/s "
                f"({r['samples']} samples, {r['distinct']} distinct, epoch {r['epoch_s']:.1f} s; "
                f"spearman {r['spearman']:+.3f}, near pairs {r['near_pairs']:.1%})",
                flush=True,
            )
    resume: dict[str, str] = {}
    if not a.skip_resume:
        for name in a.only:
            if name in ("webdataset", "ceiling", "unbroken-pipe", *EXTRA):
                resume[name] = "cannot resume" if name == "webdataset" else "-"
                continue
            path = f"{a.root}/state-{name}.pkl"
            _run_child("state", name, "0.9", path)
            r = _run_child("resume", name, path)
            resume[name] = f"{r['90%/2w']:.3f} s"
            if name == "unbroken":
                resume[name] += (
                    f" (10%: {r['10%/2w']:.3f}, 50%: {r['50%/2w']:.3f}; num_workers=0: "
                    f"{r['10%/0w']:.3f} / {r['50%/0w']:.3f} / {r['90%/0w']:.3f} s; bare "
                    f"DataLoader start: {r['bare_dataloader']:.3f} s)"
                )
            print(f"  resume {name:10s}: {resume[name]}", flush=True)
    best_anchor = max(
        (statistics.median(v) for k, v in speed.items() if k not in (*OURS, *EXTRA)),
        default=None,
    )
    print(
        "\n| loader | samples/s per seed | median | vs best anchor | near pairs |"
        " resume at 90% -> first batch |"
    )
    print("|---|---|---|---|---|---|")
    for name, v in speed.items():
        med = statistics.median(v)
        ratio = f"{med / best_anchor:.2f}x" if best_anchor else "-"
        seeds = " / ".join(f"{x / 1000:.1f}k" for x in v)
        near = statistics.median(quality[name])
        print(
            f"| {name} | {seeds} | {med / 1000:.1f}k | {ratio} | {near:.1%} | "
            f"{resume.get(name, '-')} |"
        )
    if not a.skip_tokens:
        tok: dict[str, list[float]] = {k: [] for k in ("unbroken", "unbroken-shm", "nanogpt")}
        for _ in range(3):  # interleaved, so load changes hit every reader alike
            for k in tok:
                tok[k].append(_run_child("tokens", k)["tokens_per_s"])
        nano = statistics.median(tok["nanogpt"])
        print(
            f"\n| token reader (seq_len {SEQ_LEN}, batch {TOK_BATCH}) | M tokens/s (3 runs) | median | vs nanoGPT |"
        )
        print("|---|---|---|---|")
        for k, v in tok.items():
            med = statistics.median(v)
            runs = " / ".join(f"{x / 1e6:.1f}" for x in v)
            print(f"| {k} | {runs} | {med / 1e6:.1f} | {med / nano:.2f}x |")


if __name__ == "__main__":
    main()
