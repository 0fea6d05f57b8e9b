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

Like for like (issue 23): every loader at the same worker count (2) and batch; loaders
interleaved, the order rotated per seed / round, so each takes each position in turn; the
same warm-up for all (imports before the clock; reads count after the first 10 batches; a
resume child times one untimed resume first); the load average is printed with each table.

For every loader and workload, per seed (0/1/2): steady-state samples/s (after the first 10
batches; an epoch, or ``--budget`` seconds of it), the samples each loader really delivered
(and how many distinct), and the total CPU per delivered sample - main process + DataLoader
workers, user + system, from ``getrusage`` (the workers are joined before it is read, so
``RUSAGE_CHILDREN`` holds them) over the loader's whole life (construction to shutdown). The
same decode is then run alone over the same samples in memory: ``loader's own CPU = total -
decode alone``. Each row names its transport (how a batch crosses from a worker: torch's pipe,
which sends every tensor as its own shared-memory file, or unbroken's shared-memory ring).

"ceiling": the samples already in memory (one blob + offsets, sliced like an mmap), same
decode, same collate, shuffled; through torch's stock transport ("ceiling-pipe") and through
unbroken's shared-memory ring ("ceiling-ring"); each row is set against the ceiling on its own
transport. "unbroken-pipe": ours with ``shm_transport=False``; "unbroken-noverify": ours with
``verify=False`` (only when ``StreamingDataset`` has that parameter). decode-list is a
transport test (one tensor per sample: the pipe's per-tensor cost dominates): its fair pairs
are unbroken vs ceiling-ring and unbroken-pipe vs the anchors and ceiling-pipe.

Resume (decode-tensors workload plus the pid of the process that decoded each sample): a
real run of each loader to 10/50/90% of the epoch saves its state; the position the loader
*actually* saved is printed and must equal the intended one (else the run fails). Time =
constructing a fresh dataset + loader from that state to its 1st batch and to its 10th, and
where each was made (the training process or a worker: unbroken makes a resumed run's first
batch in the training process), median of 6 fresh loaders per state (3 children per loader,
loaders rotated, 2 each) in fresh processes with the loader's modules imported. Ours also
with num_workers=0 and a bare 2-worker DataLoader's start-up (torch's floor under any loader
that waits for its workers).

Tokens (seq_len 1024, 64 Mi tokens, 3 full epochs, batch 16 and 64): unbroken's token shards
vs nanoGPT's ``get_batch`` (np.memmap per batch, random offsets, x and y as contiguous int64)
- both in the main process, and both over 2 DataLoader workers (get_batch yielded by an
IterableDataset). Ours in two forms, labelled: x and y as contiguous int64 copies (what
get_batch hands out; the headline) and as views of the one (batch, seq_len + 1) tensor.

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
# unbroken: x, y contiguous int64 copies, as nanoGPT's get_batch gives them (the headline);
# unbroken-views: x, y as views of the (batch, seq_len + 1) tokens (no copy)
TOK_MAIN = ("unbroken", "unbroken-views", "nanogpt")  # in the main process
TOK_READERS = ("unbroken", "unbroken-views", "unbroken-pipe", "nanogpt")  # with workers
# how a batch crosses from a DataLoader worker to the training process
TRANSPORT = {
    "unbroken": "shm ring",
    "unbroken-noverify": "shm ring",
    "ceiling-ring": "shm ring",
    "unbroken-pipe": "torch pipe",
    "ceiling-pipe": "torch pipe",
    "litdata": "torch pipe",
    "litdata-bd1": "torch pipe",
    "mosaicml": "torch pipe",
    "webdataset": "torch pipe",
}
WORK_LABEL = {
    "decode-tensors": "decoded tensor batches, default_collate (the headline)",
    "decode-list": (
        "decode, list collate: a transport test, not a reader test: each sample's tensor "
        "crosses torch's worker pipe as its own shared-memory file (every loader on the "
        "torch pipe lands near ceiling-pipe); compare unbroken with ceiling-ring and "
        "unbroken-pipe with the anchors and ceiling-pipe"
    ),
    "raw": "raw payload bytes passed through, list collate",
}
RESUME_BATCHES = (1, 10)
RESUME_WORK = "resume"  # decode-tensors, plus the pid of the process that made the batch
RESUME_ROUNDS = 3  # resume children per loader, loaders rotated between rounds
RESUME_REPS = 2  # fresh loaders per saved state in each child  # the batches timed after a resume (issue 23: the 1st and the 10th)


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


def decode_where(sample: dict[str, Any]) -> dict[str, Any]:
    """:func:`decode`, plus the pid of the process that decoded the sample: where a resumed
    loader's batch was made (the training process or a worker)."""
    out = decode(sample)
    out["pid"] = os.getpid()
    return out


def touch(sample: dict[str, Any]) -> tuple[str, bytes]:
    return _key(sample), bytes(sample["bin"])


def list_collate(batch: list[Any]) -> list[Any]:
    return list(batch)


def _work(work: str) -> tuple[Any, Any]:
    """(per-sample function, collate) of a workload."""
    from torch.utils.data import default_collate

    if work == "decode-tensors":
        return decode, default_collate
    if work == RESUME_WORK:
        return decode_where, default_collate
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
    pin = work in ("decode-tensors", RESUME_WORK) and _pin()
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


def _time_batches(name: str, root: str, state: Any, workers: int = WORKERS) -> list[Any]:
    """Seconds from constructing the loader to its batches ``RESUME_BATCHES`` (1st, 10th),
    and where each was made ("main": the training process, "worker": a DataLoader worker)."""
    import gc

    me = os.getpid()
    t0 = time.perf_counter()
    ld = make_loader(name, RESUME_WORK, root, 0, state, workers=workers)
    it = iter(ld)
    out: list[Any] = []
    for b in range(1, max(RESUME_BATCHES) + 1):
        batch = next(it)
        if b in RESUME_BATCHES:
            where = "main" if int(batch["pid"][0]) == me else "worker"
            out += [time.perf_counter() - t0, where]
    del it, ld, batch
    gc.collect()
    return out


def child_resume(name: str, root: str, reps: int, paths: list[str]) -> dict[str, Any]:
    """``reps`` fresh loaders per saved state, the fractions interleaved (every sample: the
    time to batch 1 and to batch 10 and where each was made); ours also with
    num_workers=0 (our own cost, without DataLoader worker start-up)."""
    states = []
    for p in paths:
        with open(p, "rb") as f:
            states.append(pickle.load(f))
    _warm_imports(name)
    _time_batches(name, root, states[0])  # page cache and lazy imports: not resume cost
    res: dict[str, Any] = {}
    for workers in (WORKERS, 0) if name == "unbroken" else (WORKERS,):
        for _ in range(reps):
            for f, st in zip(FRACS, states, strict=True):
                res.setdefault(f"{int(f * 100)}%/{workers}w", []).append(
                    _time_batches(name, root, st, workers)
                )
    if name == "unbroken":
        # the floor under any loader here: torch starting 2 workers for a 1-item dataset
        from torch.utils.data import DataLoader

        bare = []
        for _ in range(reps):
            t0 = time.perf_counter()
            it = iter(DataLoader(_One(), batch_size=None, num_workers=WORKERS))
            next(it)
            bare.append(time.perf_counter() - t0)
            del it
        res["bare_dataloader"] = bare
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
        views = name == "unbroken-views"
        for epoch in range(TOK_EPOCHS):
            ld.set_epoch(epoch)
            for tokens in ld:
                if views:  # what a loop that slices its inputs gets: no copy
                    x, _y = tokens[:, :-1], tokens[:, 1:]
                else:  # what nanoGPT's get_batch hands out: two contiguous int64 tensors
                    x, _y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
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
        res = child_resume(rest[0], a.root, int(rest[1]), rest[2:])
    elif kind == "litexplain":
        res = child_litexplain(a.root, int(rest[0]))
    else:
        res = child_tokens(rest[0], a.root, int(rest[1]), int(rest[2]))
    print("RESULT " + json.dumps(res), flush=True)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def rotated(names: list[str] | tuple[str, ...], r: int) -> list[str]:
    """``names`` in the order of round ``r``: each loader takes each position in turn."""
    k = r % len(names)
    return list(names[k:]) + list(names[:k])


def run_reads(a: argparse.Namespace, out: dict[str, Any]) -> None:
    decode_us = {w: _run_child("decode", w)["decode_us"] for w in a.work}
    for work in a.work:
        rows: dict[str, list[dict[str, Any]]] = {}
        for si, seed in enumerate(a.seeds):  # interleaved, order rotated: load hits all alike
            for name in rotated(a.only, si):
                r = _run_child("read", name, work, str(seed), str(a.budget))
                rows.setdefault(name, []).append(r)
                print(
                    f"  {work:14s} {name:17s} seed {seed}: {r['samples_per_s']:9.0f} samples/s, "
                    f"CPU {r['cpu_main_us'] + r['cpu_workers_us']:6.1f} us/sample (main "
                    f"{r['cpu_main_us']:.1f}); {r['samples']} samples, {r['distinct']} distinct,"
                    f" near pairs {r['near_pairs']:.1%}",
                    flush=True,
                )
        out["read"][work] = {"decode_us": decode_us[work], "rows": rows, "load": os.getloadavg()}
        print_read_table(work, decode_us[work], rows)


def print_read_table(work: str, dec: float, rows: dict[str, list[dict[str, Any]]]) -> None:
    speed = {k: _med([r["samples_per_s"] for r in v]) for k, v in rows.items()}
    cpu = {k: _med([r["cpu_main_us"] + r["cpu_workers_us"] for r in v]) for k, v in rows.items()}
    anchors = [k for k in rows if k not in OURS]
    best = max(anchors, key=lambda k: speed[k], default=None)
    best_own = min((cpu[k] - dec for k in anchors), default=None)
    ceil = {  # the ceiling on each transport: like against like
        TRANSPORT[k]: speed[k] for k in rows if k.startswith("ceiling")
    }
    print(
        f"\n{work}: {WORK_LABEL[work]}; decode alone {dec:.2f} us/sample; best anchor {best}; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| loader | transport | samples/s per seed | median | vs best anchor | vs ceiling, same "
        "transport | samples delivered per seed | CPU us/sample (main + workers) | loader's "
        "own us/sample | own vs best anchor's | near pairs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, v in rows.items():
        seeds = " / ".join(f"{r['samples_per_s'] / 1000:.1f}k" for r in v)
        own = cpu[k] - dec
        vs_a = f"{speed[k] / speed[best]:.2f}x" if best else "-"
        c = ceil.get(TRANSPORT[k])
        vs_c = f"{speed[k] / c:.2f}x" if c else "-"
        own_vs = f"{own / best_own:.2f}x" if best_own else "-"
        main = _med([r["cpu_main_us"] for r in v])
        near = _med([r["near_pairs"] for r in v])
        got = " / ".join(f"{r['samples']} ({r['distinct']} distinct)" for r in v)
        print(
            f"| {k} | {TRANSPORT[k]} | {seeds} | {speed[k] / 1000:.1f}k | {vs_a} | {vs_c} | {got} "
            f"| {cpu[k]:.1f} ({main:.1f} + {cpu[k] - main:.1f}) | {own:.1f} | {own_vs} | "
            f"{near:.1%} |"
        )
    print(flush=True)


def run_resume(a: argparse.Namespace, out: dict[str, Any]) -> None:
    names = [n for n in a.only if n in RESUMABLE]
    paths: dict[str, list[str]] = {}
    saved: dict[str, list[int]] = {}
    for name in names:
        for f in FRACS:
            path = f"{a.root}/state-{name}-{int(f * 100)}.pkl"
            s = _run_child("state", name, str(f), path)
            if s["saved"] != s["intended"]:
                raise RuntimeError(
                    f"{name}: state saved at {f:.0%} says position {s['saved']}, not the "
                    f"{s['intended']} samples delivered: its resume would not be a resume there"
                )
            paths.setdefault(name, []).append(path)
            saved.setdefault(name, []).append(s["saved"])
        print(f"  resume {name}: positions saved {saved[name]} (samples)", flush=True)
    runs: dict[str, dict[str, list[Any]]] = {n: {} for n in names}
    for r in range(RESUME_ROUNDS):  # loaders interleaved, order rotated
        for name in rotated(names, r):
            got = _run_child("resume", name, str(RESUME_REPS), *paths[name])
            for k, v in got.items():
                runs[name].setdefault(k, []).extend(v)
    out["resume"] = {"saved": saved, "runs": runs}
    print_resume_table(runs, saved)


def _where(xs: list[str]) -> str:
    return "/".join(sorted(set(xs)))


def print_resume_table(runs: dict[str, dict[str, list[Any]]], saved: dict[str, list[int]]) -> None:
    n = RESUME_ROUNDS * RESUME_REPS
    print(
        f"\n| resume (median of {n} fresh loaders, {WORKERS} workers unless said) | positions "
        "saved | batch 1 at 10/50/90% (s) | made in | batch 10 at 10/50/90% (s) | made in | "
        "batch 1 at 90% vs LitData | batch 10 at 90% vs LitData |"
    )
    print("|---|---|---|---|---|---|---|---|")
    lit = runs.get("litdata", {}).get("90%/2w")
    for name, res in runs.items():
        for w in (WORKERS, 0):
            rows = [res.get(f"{int(f * 100)}%/{w}w") for f in FRACS]
            if rows[0] is None:
                continue
            b1 = " / ".join(f"{_med([x[0] for x in r]):.3f}" for r in rows if r)
            b10 = " / ".join(f"{_med([x[2] for x in r]):.3f}" for r in rows if r)
            wh1 = _where([x[1] for r in rows if r for x in r])
            wh10 = _where([x[3] for r in rows if r for x in r])
            r90 = rows[-1] or []
            vs1 = vs10 = "-"
            if lit and r90 and w == WORKERS:
                vs1 = f"{_med([x[0] for x in r90]) / _med([x[0] for x in lit]):.2f}x"
                vs10 = f"{_med([x[2] for x in r90]) / _med([x[2] for x in lit]):.2f}x"
            label = name if w == WORKERS else f"{name}, num_workers=0"
            print(f"| {label} | {saved[name]} | {b1} | {wh1} | {b10} | {wh10} | {vs1} | {vs10} |")
    if "bare_dataloader" in runs.get("unbroken", {}):
        print(
            f"\nbare {WORKERS}-worker DataLoader to its first item (torch's floor under any "
            f"loader that waits for its workers): {_med(runs['unbroken']['bare_dataloader']):.3f} s"
        )
    if lit and "unbroken" in runs:
        u = runs["unbroken"]["90%/2w"]
        for i, b, goal in ((0, 1, 0.5), (2, 10, 0.8)):
            r = _med([x[i] for x in u]) / _med([x[i] for x in lit])
            print(
                f"resume at 90%, batch {b}: unbroken / LitData = {r:.2f}x (goal <= {goal}x): "
                f"{'PASS' if r <= goal else 'FAIL'}",
                flush=True,
            )


def run_tokens(a: argparse.Namespace, out: dict[str, Any]) -> None:
    res: dict[str, list[float]] = {}
    for batch in TOK_BATCHES:
        for workers in (0, WORKERS):
            names = TOK_MAIN if workers == 0 else TOK_READERS
            for r in range(3):  # interleaved, order rotated: load changes hit all alike
                for name in rotated(names, r):
                    got = _run_child("tokens", name, str(batch), str(workers))
                    res.setdefault(f"{name}/{batch}/{workers}", []).append(got["tokens_per_s"])
    out["tokens"] = res
    print(
        f"\n| token reader (seq_len {SEQ_LEN}, {TOK_EPOCHS} epochs of {TOKENS >> 20} Mi tokens; "
        "x, y as the loop gets them) | batch | processes | M tokens/s (3 runs) | median | vs "
        "get_batch, same processes |"
    )
    print("|---|---|---|---|---|---|")
    label = {
        "unbroken": "unbroken, x/y contiguous int64 (as get_batch; the headline)",
        "unbroken-views": "unbroken, x/y views of one tensor (no copy)",
        "unbroken-pipe": "unbroken over torch's pipe, x/y contiguous",
        "nanogpt": "nanoGPT get_batch, x/y contiguous int64",
    }
    for batch in TOK_BATCHES:
        for workers in (0, WORKERS):
            nano = _med(res[f"nanogpt/{batch}/{workers}"])
            for name in TOK_MAIN if workers == 0 else TOK_READERS:
                v = res[f"{name}/{batch}/{workers}"]
                runs = " / ".join(f"{x / 1e6:.1f}" for x in v)
                procs = "1 (main)" if workers == 0 else f"1 + {workers} workers"
                print(
                    f"| {label[name]} | {batch} | {procs} | {runs} | {_med(v) / 1e6:.1f} | "
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
