"""Read path, resume and tokens: unbroken's StatefulLoader vs the anchors, as users run them.

Same run, same 100,000 samples (2-6 KB random bytes + a small JSON each, ~400 MB), each
loader on its own format of them (our tar shards are also what WebDataset reads; MosaicML
Streaming reads MDS, LitData its optimized chunks; 64 MB shards/chunks everywhere), 2 DataLoader
workers, batch 64, shuffle on. Three workloads, every loader on each, side by side:

  decode-tensors  (the headline) the worker decodes each sample - ``json.loads`` of the JSON
                  plus the first 2,048 payload bytes as a float32 tensor - and the batch is
                  ``default_collate``d: {"x": (64, 2048) float32, "label": (64,), "i": (64,)};
                  ``pin_memory`` where the platform has CUDA (as the README's loop does);
  decode-list     the same decode, batches left as a list of 64 sample dicts (a custom
                  collate: one tensor per sample);
  raw             the payload passed through untouched as ``(key, bytes)``, list collate.

For every loader and workload, per seed (0/1/2, loaders interleaved so load changes hit all
alike): steady-state samples/s (after the first 10 batches; an epoch, or ``--budget`` seconds
of it), and the total CPU per delivered sample - main process + DataLoader workers, user +
system, from ``getrusage`` (the workers are joined before it is read, so ``RUSAGE_CHILDREN``
holds them) over the loader's whole life (construction to shutdown). The same decode is then
run alone over the same samples in memory: ``loader's own CPU = total - decode alone``.

"ceiling": the samples already in memory (one blob + offsets, sliced like an mmap), same
decode, same collate, shuffled; through torch's stock transport ("ceiling-pipe") and through
unbroken's shared-memory ring ("ceiling-ring"); "ceiling" in the summary is the better one.
"unbroken-pipe": ours with ``shm_transport=False``; "unbroken-noverify": ours with
``verify=False`` (only when ``StreamingDataset`` has that parameter).

Resume (decode-tensors workload, the one MosaicML counts right): a real run of each loader to
10/50/90% of the epoch saves its state; the position the loader *actually* saved is printed
beside the time and must equal the intended one (else the run fails). Time = constructing a
fresh dataset + loader from that state to its first batch (and to its second: unbroken makes
a run's first batch in the training process before its workers start, so their start-up
lands before the second), median of 5 in a fresh process with the loader's modules imported.
Ours also with num_workers=0 and a bare 2-worker DataLoader's start-up (torch's floor under
any loader that waits for its workers).

Tokens (seq_len 1024, 64 Mi tokens, 3 full epochs, batch 16 and 64): unbroken's token shards
vs nanoGPT's ``get_batch`` (np.memmap per batch, random offsets, x and y as int64) - both in
the main process, and both over 2 DataLoader workers (get_batch yielded by an IterableDataset).

Every measurement runs in a fresh subprocess of the same interpreter. Run from the anchor
venv (benchmarks/_anchor_env.sh), under the box's benchmark lock:

    flock /tmp/unbroken-bench.lock .venv-bench/bin/python benchmarks/data_read.py
    ... data_read.py --only unbroken litdata ceiling-ring --work decode-tensors --skip-tokens
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

ROOT = "/tmp/unbroken-bench-read"
N = 100_000
BATCH = 64
WORKERS = 2
SHARD = 64 << 20
DIM = 2048  # payload bytes decoded into the float tensor (every payload has >= 2048)
LOADERS = (
    "unbroken",
    "unbroken-pipe",
    "litdata",
    "mosaicml",
    "webdataset",
    "ceiling-pipe",
    "ceiling-ring",
)
OURS = ("unbroken", "unbroken-pipe", "unbroken-noverify", "ceiling-pipe", "ceiling-ring")
# litdata-bd1: LitData with batch_decode=1 (decode only the requested row), the workaround for
# its seed-dependent slow-down (RESULTS.md, issue 4); unbroken-noverify: verify=False
EXTRA = ("litdata-bd1", "unbroken-noverify")
WORKS = ("decode-tensors", "decode-list", "raw")
RESUMABLE = ("unbroken", "litdata", "mosaicml")
FRACS = (0.1, 0.5, 0.9)
SEQ_LEN = 1024
TOK_BATCHES = (16, 64)
TOK_EPOCHS = 3
TOKENS = 64 << 20  # 64 Mi tokens (uint16): 128 MB
TOK_READERS = ("unbroken", "unbroken-pipe", "nanogpt")  # with workers


# --- the data ----------------------------------------------------------------------------


def make_sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng([7, i])
    size = int(rng.integers(2048, 6145))
    meta = json.dumps({"i": i, "label": i % 1000, "size": size}).encode()
    return {"__key__": f"{i:08d}", "bin": rng.bytes(size), "json": meta}


def _litdata_item(i: int) -> dict[str, Any]:
    s = make_sample(i)
    return {"key": s["__key__"], "bin": s["bin"], "json": s["json"]}


def _pack_tar(root: str, n: int) -> None:
    from unbroken.data.prepare.pack import pack

    pack((make_sample(i) for i in range(n)), f"{root}/tar", shard_size=SHARD, progress=False)


def _tar_has_checksums(root: str) -> bool:
    """Whether our shards' indexes record per-sample checksums: ones packed by an unbroken
    older than issue 12 do not, and would make the verify-on row read unverified."""
    from unbroken.data.tar.reader import index_format

    idx = sorted(f for f in os.listdir(f"{root}/tar") if f.endswith(".idx"))
    with open(f"{root}/tar/{idx[0]}", "rb") as f:
        return index_format(f.read(8)) >= 2


def prepare(root: str, n: int) -> None:
    os.makedirs(root, exist_ok=True)
    done = os.path.join(root, f"ready-{n}")
    if os.path.exists(done):
        if not _tar_has_checksums(root):
            print(f"{root}/tar: indexes without per-sample checksums; re-packing", flush=True)
            shutil.rmtree(f"{root}/tar")
            _pack_tar(root, n)
        return
    t0 = time.perf_counter()
    _pack_tar(root, n)
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
    from unbroken.data.manifest import DatasetManifest
    from unbroken.data.tokens.shard import TokenShardWriter

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
        infos.append(w.commit_info(SEQ_LEN))
        with open(f"{out}/{name}", "rb") as f:
            flat.write(f.read())
    flat.close()
    DatasetManifest.create("tokens", infos, dtype="uint16", eos_id=0, seq_len=SEQ_LEN).save(out)


# --- the same per-sample functions and collates for every loader -------------------------


def _key(sample: dict[str, Any]) -> str:
    return sample["__key__"] if "__key__" in sample else sample["key"]


def decode(sample: dict[str, Any]) -> dict[str, Any]:
    """What a user's transform does: parse the metadata, turn payload bytes into a tensor."""
    import torch

    meta = json.loads(bytes(sample["json"]))  # bytes(): LitData hands out memoryviews
    x = torch.from_numpy(np.frombuffer(sample["bin"], np.uint8, DIM).astype(np.float32))
    return {"x": x, "label": meta["label"], "i": meta["i"]}


def touch(sample: dict[str, Any]) -> tuple[str, bytes]:
    return _key(sample), bytes(sample["bin"])


def list_collate(batch: list[Any]) -> list[Any]:
    return list(batch)


def _work(work: str) -> tuple[Any, Any]:
    """(per-sample function, collate) of a workload."""
    from torch.utils.data import default_collate

    if work == "decode-tensors":
        return decode, default_collate
    if work == "decode-list":
        return decode, list_collate
    return touch, list_collate


def batch_ids(batch: Any, work: str) -> list[int]:
    """Sample indexes of a delivered batch (to count distinct samples and judge shuffle)."""
    if work == "decode-tensors":
        return batch["i"].tolist()
    if work == "decode-list":
        return [s["i"] for s in batch]
    return [int(k) for k, _ in batch]


def _pin() -> bool:
    import torch

    return torch.cuda.is_available()


def _has_verify() -> bool:
    from unbroken.data.stream.dataset import StreamingDataset

    return "verify" in inspect.signature(StreamingDataset).parameters


# --- loaders -------------------------------------------------------------------------------


def make_loader(
    name: str, work: str, root: str, seed: int, state: Any = None, workers: int = WORKERS
) -> Any:
    fn, collate = _work(work)
    pin = work == "decode-tensors" and _pin()
    if name in ("unbroken", "unbroken-pipe", "unbroken-noverify"):
        from unbroken.data.stream.dataset import StreamingDataset
        from unbroken.data.stream.loader import StatefulLoader

        extra = {"verify": False} if name == "unbroken-noverify" else {}
        ds = StreamingDataset(f"{root}/tar", seed=seed, transform=fn, **extra)
        ld = StatefulLoader(
            ds,
            batch_size=BATCH,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=pin and workers > 0,
            shm_transport=name != "unbroken-pipe",
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
            .map(fn)
            .batched(BATCH, collation_fn=collate, partial=True)
        )
        return wds.WebLoader(pipe, batch_size=None, num_workers=workers, pin_memory=pin)
    if name == "mosaicml":
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()

        class _Mapped(StreamingDataset):
            def __getitem__(self, i: Any) -> Any:
                return fn(super().__getitem__(i))

        ds = _Mapped(local=f"{root}/mds", shuffle=True, shuffle_seed=seed, batch_size=BATCH)
        ld = StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=workers, collate_fn=collate, pin_memory=pin
        )
        if state is not None:
            ld.load_state_dict(state)
        return ld
    if name in ("litdata", "litdata-bd1"):
        from litdata import StreamingDataLoader, StreamingDataset

        extra = {"batch_decode": 1} if name == "litdata-bd1" else {}
        ds = StreamingDataset(f"{root}/litdata", shuffle=True, seed=seed, transform=fn, **extra)
        ld = StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=workers, collate_fn=collate, pin_memory=pin
        )
        if state is not None:
            ld.load_state_dict(state)
        return ld
    if name in ("ceiling-pipe", "ceiling-ring"):
        return _Ceiling(work, seed, ring=name == "ceiling-ring", pin=pin)
    raise ValueError(f"unknown loader {name!r}; one of {LOADERS + EXTRA}")


class _InMemory(IterableDataset):
    """The samples in memory as one payload blob + one JSON blob + offsets (sliced per read
    like an mmap, no per-sample objects to copy-on-write after the fork), shuffled, batches
    dealt round-robin to the workers; each worker decodes and collates its batches."""

    def __init__(self, work: str, seed: int, ring_fds: Any = None) -> None:
        super().__init__()
        self.work, self.seed, self.ring_fds = work, seed, ring_fds
        bins, metas = [], []
        for i in range(N):
            s = make_sample(i)
            bins.append(s["bin"])
            metas.append(s["json"])
        self.bin_off = np.cumsum([0] + [len(b) for b in bins])
        self.json_off = np.cumsum([0] + [len(m) for m in metas])
        self.bins, self.metas = b"".join(bins), b"".join(metas)

    def _sample(self, i: int) -> dict[str, Any]:
        bo, jo = self.bin_off, self.json_off
        return {
            "__key__": f"{i:08d}",
            "bin": self.bins[bo[i] : bo[i + 1]],
            "json": self.metas[jo[i] : jo[i + 1]],
        }

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        fn, collate = _work(self.work)
        order = np.random.default_rng(self.seed).permutation(N).tolist()
        send = None
        if self.ring_fds and info is not None:
            from unbroken.data.stream.transport import RingSender

            send = RingSender(worker_id=wid, fd_spec=self.ring_fds[wid]).collate
        for b in range(wid, -(-N // BATCH), nw):
            samples = [fn(self._sample(i)) for i in order[b * BATCH : (b + 1) * BATCH]]
            yield send(samples, collate) if send else collate(samples)


class _Ceiling:
    """A DataLoader over :class:`_InMemory`: torch's stock transport, or unbroken's ring."""

    def __init__(self, work: str, seed: int, ring: bool, pin: bool) -> None:
        from torch.utils.data import DataLoader

        from unbroken.data.stream.transport import RingReceiver, worker_fds

        self.fds = worker_fds(WORKERS) if ring else None
        self.dl = DataLoader(
            _InMemory(work, seed, self.fds),
            batch_size=None,
            num_workers=WORKERS,
            pin_memory=pin and not ring,
        )
        self.rx = RingReceiver(self.fds, pin=pin) if ring else None

    def __iter__(self) -> Any:
        rx = self.rx
        try:
            for item in self.dl:
                yield rx.unpack(item) if rx is not None else item
        finally:
            if rx is not None:
                rx.close()


def _cpu() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def child_read(name: str, work: str, root: str, seed: int, budget: float) -> dict[str, Any]:
    import gc

    _warm_imports(name)
    if name.startswith("ceiling"):
        # building the in-memory samples is not the loader's cost: make them first
        ld = make_loader(name, work, root, seed)
        c0 = _cpu()
    else:
        c0 = _cpu()
        ld = make_loader(name, work, root, seed)
    ids: list[int] = []
    n = n0 = 0
    t0 = None
    it = iter(ld)
    for b, batch in enumerate(it):
        if b == 10:
            t0, n0 = time.perf_counter(), n
        got = batch_ids(batch, work)
        ids.extend(got)
        n += len(got)
        if t0 is not None and time.perf_counter() - t0 > budget:
            break
    t1 = time.perf_counter()
    if t0 is None:
        raise RuntimeError(f"{name}: fewer than 10 batches")
    del it, ld, batch  # shuts the workers down (joined: their CPU lands in RUSAGE_CHILDREN)
    main_end = _cpu()[0]
    gc.collect()  # in case a cycle held an iterator; its own ~50 ms are not the loader's
    c1 = (main_end, _cpu()[1])
    order = np.array(ids, dtype=np.int64)
    return {
        "samples_per_s": (n - n0) / (t1 - t0),
        "samples": n,
        "distinct": len(set(ids)),
        "cpu_main_us": (c1[0] - c0[0]) / n * 1e6,
        "cpu_workers_us": (c1[1] - c0[1]) / n * 1e6,
        **shuffle_quality(order),
    }


def child_decode(work: str) -> dict[str, Any]:
    """CPU per sample of the workload's per-sample function alone, on in-memory samples
    (bytes, as our reader and MosaicML hand them out), median of 3 passes."""
    fn, _ = _work(work)
    samples = [make_sample(i) for i in range(20_000)]
    fn(samples[0])
    passes = []
    for _ in range(3):
        t0 = time.process_time()
        for s in samples:
            fn(s)
        passes.append((time.process_time() - t0) / len(samples) * 1e6)
    return {"decode_us": statistics.median(passes)}


def shuffle_quality(order: np.ndarray) -> dict[str, float]:
    """Of the delivered order (sample index at each position): the share of consecutive
    pairs whose indexes lie within 1,000 of each other (same ~4 MB region of the data; 2% for
    a uniform random permutation of 100k)."""
    if order.size < 2:
        return {"near_pairs": float("nan")}
    return {"near_pairs": float((np.abs(np.diff(order)) < 1000).mean())}


# --- resume ----------------------------------------------------------------------------------

RESUME_WORK = "decode-tensors"


def saved_position(name: str, state: dict[str, Any]) -> int:
    """The sample position a loader's state says it resumes from."""
    if name == "unbroken":
        return int(state["samples_consumed"])
    if name == "litdata":
        return int(state["num_samples_yielded"])
    if name == "mosaicml":
        return int(state["sample_in_epoch"])
    raise ValueError(name)


def child_state(name: str, root: str, frac: float, path: str) -> dict[str, Any]:
    """Run a real loader to ``frac`` of the epoch and save its state."""
    import gc

    ld = make_loader(name, RESUME_WORK, root, 0)
    stop = int(frac * N / BATCH)
    it = iter(ld)
    for b, _ in enumerate(it):
        if b + 1 == stop:
            break
    state = ld.state_dict()
    del it
    gc.collect()
    with open(path, "wb") as f:
        pickle.dump(state, f)
    return {"intended": stop * BATCH, "saved": saved_position(name, state)}


def _time_first_batch(
    name: str, root: str, state: Any, workers: int = WORKERS
) -> tuple[float, float]:
    """Seconds from constructing the loader to its first batch, and to its second."""
    import gc

    t0 = time.perf_counter()
    ld = make_loader(name, RESUME_WORK, root, 0, state, workers=workers)
    it = iter(ld)
    next(it)
    t1 = time.perf_counter()
    next(it)
    t2 = time.perf_counter()
    del it, ld
    gc.collect()
    return t1 - t0, t2 - t0


def child_resume(name: str, root: str, paths: list[str]) -> dict[str, Any]:
    """Median of 5 fresh loaders per saved state, the fractions interleaved; ours also with
    num_workers=0 (our own cost, without DataLoader worker start-up)."""
    states = []
    for p in paths:
        with open(p, "rb") as f:
            states.append(pickle.load(f))
    _warm_imports(name)
    _time_first_batch(name, root, states[0])  # page cache and lazy imports: not resume cost
    res: dict[str, Any] = {}
    for workers in (WORKERS, 0) if name == "unbroken" else (WORKERS,):
        times: list[list[tuple[float, float]]] = [[] for _ in states]
        for _ in range(5):
            for k, st in enumerate(states):
                times[k].append(_time_first_batch(name, root, st, workers))
        for f, ts in zip(FRACS, times, strict=True):
            res[f"{int(f * 100)}%/{workers}w"] = statistics.median(t[0] for t in ts)
            res[f"{int(f * 100)}%/{workers}w/2nd"] = statistics.median(t[1] for t in ts)
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
    import torch.utils.data  # noqa: F401

    if name.startswith("unbroken") or name.startswith("ceiling"):
        import unbroken.data.stream.loader  # noqa: F401
    elif name == "mosaicml":
        import streaming  # noqa: F401
    elif name.startswith("litdata"):
        import litdata  # noqa: F401
    elif name == "webdataset":
        import webdataset  # noqa: F401


# --- tokens ----------------------------------------------------------------------------------


class _GetBatch(IterableDataset):
    """nanoGPT's get_batch in DataLoader workers: ``n`` batches split between them."""

    def __init__(self, root: str, batch: int, n: int) -> None:
        super().__init__()
        self.root, self.batch, self.n = root, batch, n

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for _ in range(wid, self.n, nw):
            yield get_batch(self.root, self.batch)


def get_batch(root: str, batch: int) -> Any:
    """nanoGPT train.py get_batch (CPU branch), memmap re-created per batch as there."""
    import torch

    data = np.memmap(f"{root}/train.bin", dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - SEQ_LEN, (batch,))
    x = torch.stack([torch.from_numpy(data[i : i + SEQ_LEN].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + SEQ_LEN].astype(np.int64)) for i in ix])
    return x, y


def child_tokens(name: str, root: str, batch: int, workers: int) -> dict[str, Any]:
    """Tokens/s over ``TOK_EPOCHS`` epochs of our token dataset (or as many get_batch calls),
    steady state after the first 10 batches."""
    from unbroken.data.stream.dataset import StreamingDataset
    from unbroken.data.stream.loader import StatefulLoader

    ds = StreamingDataset(f"{root}/tokens", seed=0)
    total = TOK_EPOCHS * (ds.epoch_length // batch)
    n = 0
    t0 = None
    b = 0

    def tick(x: Any) -> None:
        nonlocal n, t0, b
        if b == 10:
            t0 = time.perf_counter()
        elif t0 is not None:
            n += x.numel()
        b += 1

    if name == "nanogpt":
        if workers == 0:
            for _ in range(total):
                x, _y = get_batch(root, batch)
                tick(x)
        else:
            from torch.utils.data import DataLoader

            for x, _y in DataLoader(
                _GetBatch(root, batch, total), batch_size=None, num_workers=workers
            ):
                tick(x)
    else:
        ld = StatefulLoader(
            ds,
            batch_size=batch,
            num_workers=workers,
            last_batch="drop",
            shm_transport=name != "unbroken-pipe",
        )
        for epoch in range(TOK_EPOCHS):
            ld.set_epoch(epoch)
            for tokens in ld:
                x, _y = tokens[:, :-1], tokens[:, 1:]
                tick(x)
    if t0 is None:
        raise RuntimeError("fewer than 10 token batches")
    return {"tokens_per_s": n / (time.perf_counter() - t0), "batches": b}


# --- LitData's seed dependence (issue 4) -----------------------------------------------------


def child_litexplain(root: str, seed: int) -> dict[str, Any]:
    """Why LitData's speed depends on the seed: where its chunk split between the workers
    falls, how many rows its decoder decodes per delivered item, and the workers' CPU time
    (raw workload)."""
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
    read = child_read("litdata", "raw", root, seed, 1e9)
    return {
        "intervals": [[[int(x) for x in iv] for iv in w] for w in intervals],
        "misaligned_items": misaligned,
        "rows_decoded_per_item": rows["n"] / max(1, items),
        "worker_cpu_us": read["cpu_workers_us"],
        "samples_per_s": read["samples_per_s"],
    }


# --- driver --------------------------------------------------------------------------------


def _run_child(*args: str, timeout: float = 1800) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _child(a: argparse.Namespace) -> None:
    kind, *rest = a.child
    if kind == "read":
        res = child_read(rest[0], rest[1], a.root, int(rest[2]), float(rest[3]))
    elif kind == "decode":
        res = child_decode(rest[0])
    elif kind == "state":
        res = child_state(rest[0], a.root, float(rest[1]), rest[2])
    elif kind == "resume":
        res = child_resume(rest[0], a.root, rest[1:])
    elif kind == "litexplain":
        res = child_litexplain(a.root, int(rest[0]))
    else:
        res = child_tokens(rest[0], a.root, int(rest[1]), int(rest[2]))
    print("RESULT " + json.dumps(res), flush=True)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def run_reads(a: argparse.Namespace, out: dict[str, Any]) -> None:
    decode_us = {w: _run_child("decode", w)["decode_us"] for w in a.work}
    for work in a.work:
        rows: dict[str, list[dict[str, Any]]] = {}
        for seed in a.seeds:  # loaders interleaved: a change in machine load hits all alike
            for name in a.only:
                r = _run_child("read", name, work, str(seed), str(a.budget))
                rows.setdefault(name, []).append(r)
                print(
                    f"  {work:14s} {name:17s} seed {seed}: {r['samples_per_s']:9.0f} samples/s, "
                    f"CPU {r['cpu_main_us'] + r['cpu_workers_us']:6.1f} us/sample (main "
                    f"{r['cpu_main_us']:.1f}); {r['samples']} samples, {r['distinct']} distinct,"
                    f" near pairs {r['near_pairs']:.1%}",
                    flush=True,
                )
        out["read"][work] = {"decode_us": decode_us[work], "rows": rows}
        print_read_table(work, decode_us[work], rows)


def print_read_table(work: str, dec: float, rows: dict[str, list[dict[str, Any]]]) -> None:
    speed = {k: _med([r["samples_per_s"] for r in v]) for k, v in rows.items()}
    cpu = {k: _med([r["cpu_main_us"] + r["cpu_workers_us"] for r in v]) for k, v in rows.items()}
    anchors = [k for k in rows if k not in OURS]
    best = max(anchors, key=lambda k: speed[k], default=None)
    best_own = min((cpu[k] - dec for k in anchors), default=None)
    ceil = max((speed[k] for k in rows if k.startswith("ceiling")), default=None)
    print(
        f"\n{work}: decode alone {dec:.2f} us/sample; best anchor {best}; ceiling = the better "
        "ceiling row"
    )
    print(
        "| loader | samples/s per seed | median | vs best anchor | vs ceiling | CPU us/sample "
        "(main + workers) | loader's own us/sample | own vs best anchor's | near pairs |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for k, v in rows.items():
        seeds = " / ".join(f"{r['samples_per_s'] / 1000:.1f}k" for r in v)
        own = cpu[k] - dec
        vs_a = f"{speed[k] / speed[best]:.2f}x" if best else "-"
        vs_c = f"{speed[k] / ceil:.2f}x" if ceil else "-"
        own_vs = f"{own / best_own:.2f}x" if best_own else "-"
        main = _med([r["cpu_main_us"] for r in v])
        near = _med([r["near_pairs"] for r in v])
        print(
            f"| {k} | {seeds} | {speed[k] / 1000:.1f}k | {vs_a} | {vs_c} | {cpu[k]:.1f} "
            f"({main:.1f} + {cpu[k] - main:.1f}) | {own:.1f} | {own_vs} | {near:.1%} |"
        )
    print(flush=True)


def run_resume(a: argparse.Namespace, out: dict[str, Any]) -> None:
    res: dict[str, Any] = {}
    for name in [n for n in a.only if n in RESUMABLE]:
        paths, saved = [], []
        for f in FRACS:
            path = f"{a.root}/state-{name}-{int(f * 100)}.pkl"
            s = _run_child("state", name, str(f), path)
            if s["saved"] != s["intended"]:
                raise RuntimeError(
                    f"{name}: state saved at {f:.0%} says position {s['saved']}, not the "
                    f"{s['intended']} samples delivered: its resume would not be a resume there"
                )
            paths.append(path)
            saved.append(s["saved"])
        r = _run_child("resume", name, *paths)
        r["saved"] = saved
        res[name] = r
        line = ", ".join(
            f"{int(f * 100)}% (saved {p}): {r[f'{int(f * 100)}%/2w']:.3f} s "
            f"(2nd batch {r[f'{int(f * 100)}%/2w/2nd']:.3f})"
            for f, p in zip(FRACS, saved, strict=True)
        )
        if name == "unbroken":
            line += "; num_workers=0: " + " / ".join(
                f"{r[f'{int(f * 100)}%/0w']:.3f}" for f in FRACS
            )
            line += f" s; bare 2-worker DataLoader start: {r['bare_dataloader']:.3f} s"
        print(f"  resume {name:9s}: {line}", flush=True)
    out["resume"] = res
    if "unbroken" in res and "litdata" in res:
        ratio = res["unbroken"]["90%/2w"] / res["litdata"]["90%/2w"]
        print(f"  resume at 90%: unbroken / LitData = {ratio:.2f}x (goal <= 0.5x)", flush=True)


def run_tokens(a: argparse.Namespace, out: dict[str, Any]) -> None:
    res: dict[str, list[float]] = {}
    for batch in TOK_BATCHES:
        for workers in (0, WORKERS):
            names = ("unbroken", "nanogpt") if workers == 0 else TOK_READERS
            for _ in range(3):  # interleaved, so load changes hit all readers alike
                for name in names:
                    r = _run_child("tokens", name, str(batch), str(workers))
                    res.setdefault(f"{name}/{batch}/{workers}", []).append(r["tokens_per_s"])
    out["tokens"] = res
    print(
        f"\n| token reader (seq_len {SEQ_LEN}, {TOK_EPOCHS} epochs of {TOKENS >> 20} Mi tokens) "
        "| batch | processes | M tokens/s (3 runs) | median | vs get_batch, same processes |"
    )
    print("|---|---|---|---|---|---|")
    for batch in TOK_BATCHES:
        for workers in (0, WORKERS):
            nano = _med(res[f"nanogpt/{batch}/{workers}"])
            for name in ("unbroken", "nanogpt") if workers == 0 else TOK_READERS:
                v = res[f"{name}/{batch}/{workers}"]
                runs = " / ".join(f"{x / 1e6:.1f}" for x in v)
                procs = "1 (main)" if workers == 0 else f"1 + {workers} workers"
                print(
                    f"| {name} | {batch} | {procs} | {runs} | {_med(v) / 1e6:.1f} | "
                    f"{_med(v) / nano:.2f}x |"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", default=None, choices=LOADERS + EXTRA)
    ap.add_argument("--work", nargs="+", default=list(WORKS), choices=WORKS)
    ap.add_argument(
        "--budget", type=float, default=20.0, help="seconds of steady state per read at most"
    )
    ap.add_argument("--skip-reads", action="store_true")
    ap.add_argument("--skip-tokens", action="store_true")
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument(
        "--explain-litdata", action="store_true", help="only: why LitData's speed swings by seed"
    )
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a)
        return
    if a.only is None:
        a.only = list(LOADERS) + (["unbroken-noverify"] if _has_verify() else [])
    elif "unbroken-noverify" in a.only and not _has_verify():
        print("StreamingDataset has no `verify` parameter in this build: no noverify row")
        a.only.remove("unbroken-noverify")
    prepare(a.root, N)
    if a.explain_litdata:
        for seed in a.seeds:
            r = _run_child("litexplain", str(seed))
            print(
                f"litdata seed {seed}: {r['samples_per_s']:8.0f} samples/s, worker CPU "
                f"{r['worker_cpu_us']:.1f} us/sample, {r['rows_decoded_per_item']:.1f} rows "
                f"decoded per item, {r['misaligned_items']} items in worker intervals "
                f"misaligned to the 256-row decode window; intervals {r['intervals']}",
                flush=True,
            )
        return
    print(
        f"data: {N} samples, batch {BATCH}, {WORKERS} workers, shuffle on, pin_memory "
        f"{_pin()}; cpus={os.cpu_count()}; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    out: dict[str, Any] = {"read": {}, "load_before": os.getloadavg()}
    if not a.skip_reads:
        run_reads(a, out)
    if not a.skip_resume:
        run_resume(a, out)
    if not a.skip_tokens:
        run_tokens(a, out)
    out["load_after"] = os.getloadavg()
    print(f"load average after: {out['load_after'][0]:.1f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
