"""A dataset 4x larger than the local cache, streamed from S3: unbroken vs the anchors.

Same run, same samples (``--samples``, default 100,000; 2-6 KB random bytes + a small JSON
each, data_read.py's recipe), each loader on its own format of them (our tar shards, MosaicML
Streaming's MDS, LitData's optimized chunks; ``--shard`` MB shards/chunks everywhere, default
4), uploaded to one moto S3 server (its own process on 127.0.0.1, with a byte counter around
its WSGI app). Each loader reads two epochs through a local cache limited to 25% of *its*
dataset's size, 2 DataLoader workers, batches of 256, shuffle on, the same decode
(``json.loads`` of the metadata + the first 2,048 payload bytes as a float tensor) and
``default_collate``:

* unbroken: ``StreamingDataset("s3://...", cache=CacheConfig(cache_dir=, cache_limit=))``,
  **defaults** (shuffle window and read-ahead chosen to fit the limit, issue 22 item 3);
  ``--window N`` pins the window;
* MosaicML Streaming: ``StreamingDataset(remote="s3://...", local=, cache_limit=,
  shuffle_block_size=5000)`` (its default block of 262,144 samples spans the whole dataset,
  which a 25% cache can only thrash on);
* LitData: ``StreamingDataset("s3://...", cache_dir=, max_cache_size=)``;
* s3torchconnector (AWS): ``S3IterableDataset.from_prefix("s3://.../tar/", enable_sharding=True)``
  (objects split over the workers) + a DataLoader; each tar shard is read as a stream
  (``tarfile`` ``r|``), samples pass a 5,000-sample shuffle buffer per worker (AWS's
  recommended pattern with WebDataset-style shards); no cache: every epoch downloads it all;
* unbroken-local (reference, not a contender): our loader on the same tar shards in a local
  directory, no cache and no network - what this decode allows on this box.

CPU: the loader's whole process tree (the loader process, its DataLoader workers and any
fetcher process: every process of the child's session, read from ``/proc/<pid>/stat`` every
50 ms, the largest utime + stime seen per pid, less the CPU of the benchmark's own measuring
threads: this sampler and the cache watcher), per epoch, and per GB downloaded; the moto
server's CPU per epoch too (it shares the box's cores with the loader).

Per epoch: samples/s over the whole epoch (its first batch included: an epoch that waits for
the network shows it), samples delivered and distinct, bytes the server sent (GET bodies,
counted at the server), and the peak bytes under the cache directory (a watcher thread
walking it, idle 50x as long as its last walk took, at least 2 ms: every loader's
measurement costs it the same <= 2% of a core). Every loader runs in a fresh subprocess of
the same interpreter.

Run from the anchor venv, from the repository root, under the bench lock:

    flock /tmp/unbroken-bench.lock env PYTHONPATH=$PWD/src \\
        /work/main/.venv-bench/bin/python benchmarks/data_remote.py [--only unbroken mosaicml]

``UNBROKEN_BENCH_SHARD_MB=64`` (shard size), ``UNBROKEN_BENCH_SAMPLES=400000`` (dataset
size), ``UNBROKEN_BENCH_WINDOW=5000`` (pin unbroken's window instead of the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import torch

N = int(os.environ.get("UNBROKEN_BENCH_SAMPLES", "100000"))
BATCH = 256
WORKERS = 2
SHARD = int(os.environ.get("UNBROKEN_BENCH_SHARD_MB", "4")) << 20
ROOT = "/tmp/unbroken-bench-remote" + (
    "" if (N, SHARD) == (100_000, 4 << 20) else f"-{N}-{SHARD >> 20}mb"
)
WINDOW = 5000  # MosaicML's shuffle block, s3torchconnector's buffer
UB_WINDOW = int(os.environ.get("UNBROKEN_BENCH_WINDOW", "0")) or None  # None: the defaults
CACHE_FRAC = 0.25
EPOCHS = 2
LOADERS = ("unbroken", "mosaicml", "litdata", "s3torchconnector", "unbroken-local")
# unbroken-local: the same tar shards, the same decode, read from the local directory (no
# cache, no network): the ceiling of this decode on this box, for reference.
_CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET = "bench"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _moto import moto_process  # noqa: E402
from data_read import _litdata_item, make_sample  # noqa: E402 - same samples as data_read

# --- the data ------------------------------------------------------------------------------


def prepare(root: str, formats: set[str]) -> None:
    """The formats the loaders run need (each made once, then kept)."""
    os.makedirs(root, exist_ok=True)
    for fmt in sorted(formats):
        done = os.path.join(root, f"ready-{fmt}-{N}-{SHARD}")
        if os.path.exists(done) or os.path.exists(os.path.join(root, f"ready-{N}-{SHARD}")):
            continue
        shutil.rmtree(os.path.join(root, fmt), ignore_errors=True)
        t0 = time.perf_counter()
        _MAKE[fmt](root)
        open(done, "w").close()
        print(f"prepared {root}/{fmt} in {time.perf_counter() - t0:.0f} s", flush=True)


def _make_tar(root: str) -> None:
    from unbroken.data.prepare.pack import pack

    pack(
        (make_sample(i) for i in range(N)),
        f"{root}/tar",
        shard_size=SHARD,
        progress=False,
        fsync=False,
    )


def _make_mds(root: str) -> None:
    from streaming import MDSWriter

    cols = {"key": "str", "bin": "bytes", "json": "bytes"}
    with MDSWriter(out=f"{root}/mds", columns=cols, size_limit=SHARD) as w:
        for i in range(N):
            w.write(_litdata_item(i))


def _make_litdata(root: str) -> None:
    import litdata

    litdata.optimize(
        fn=_litdata_item,
        inputs=list(range(N)),
        output_dir=f"{root}/litdata",
        chunk_bytes=SHARD,
        num_workers=1,
        verbose=False,
    )


_MAKE = {"tar": _make_tar, "mds": _make_mds, "litdata": _make_litdata}


WATCH_IDLE = 50
"""The cache watcher sleeps this many times as long as its last walk took (CPU), >= 2 ms."""


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass  # evicted between listing and stat
    return total


# --- the S3 server: moto behind a byte counter ---------------------------------------------


def serve(port_file: str) -> None:
    import logging

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = DomainDispatcherApplication(create_backend_app)
    counts = {"get_bytes": 0, "gets": 0, "requests": 0}
    lock = threading.Lock()

    def counting(environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == "/__counts__":
            body = json.dumps(counts).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        with lock:
            counts["requests"] += 1
        out = app(environ, start_response)
        if environ.get("REQUEST_METHOD") != "GET":
            return out

        def counted() -> Any:
            n = 0
            try:
                for chunk in out:
                    n += len(chunk)
                    yield chunk
            finally:
                with lock:
                    counts["get_bytes"] += n
                    counts["gets"] += 1
                close = getattr(out, "close", None)
                if close is not None:
                    close()

        return counted()

    server = make_server(
        "127.0.0.1", 0, counting, threaded=True, request_handler=MotoRequestHandler
    )
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(port_file + ".tmp", port_file)
    server.serve_forever()


def counts(endpoint: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{endpoint}/__counts__", timeout=30) as r:
        return json.loads(r.read())


def upload(endpoint: str, root: str, formats: set[str]) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.mkdir(BUCKET)
    for fmt in sorted(formats):
        fs.put(f"{root}/{fmt}/", f"{BUCKET}/{fmt}/", recursive=True)


# --- the same decode and collate for every loader ------------------------------------------


def decode(key: str, payload: Any, meta: Any) -> dict[str, Any]:
    m = json.loads(bytes(meta))
    x = torch.frombuffer(bytearray(payload[:2048]), dtype=torch.uint8).float()
    return {"x": x, "label": m["label"], "i": m["i"], "size": m["size"]}


def decode_tar(s: dict[str, Any]) -> dict[str, Any]:
    return decode(s["__key__"], s["bin"], s["json"])


def decode_dict(s: dict[str, Any]) -> dict[str, Any]:
    return decode(s["key"], s["bin"], s["json"])


# --- loaders --------------------------------------------------------------------------------


def make_loader(name: str, endpoint: str, cache: str, limit: int) -> Any:
    from torch.utils.data import default_collate

    url = f"s3://{BUCKET}"
    if name == "unbroken-local":
        from unbroken.data.stream.dataset import StreamingDataset
        from unbroken.data.stream.loader import StatefulLoader

        local = os.path.join(os.path.dirname(cache), "tar")  # cache is <root>/cache-<name>
        ds = StreamingDataset(local, seed=0, shuffle_window=WINDOW, transform=decode_tar)
        return StatefulLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=default_collate)
    if name == "unbroken":
        from unbroken.data import CacheConfig, StatefulLoader, StreamingDataset

        ds = StreamingDataset(
            f"{url}/tar",
            seed=0,
            shuffle_window=UB_WINDOW,
            transform=decode_tar,
            cache=CacheConfig(
                cache_dir=cache,
                cache_limit=limit,
                storage_options={"client_kwargs": {"endpoint_url": endpoint}},
            ),
        )
        return StatefulLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=default_collate)
    if name == "mosaicml":
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()

        class _Decoded(StreamingDataset):
            def __getitem__(self, i: Any) -> Any:
                return decode_dict(super().__getitem__(i))

        ds = _Decoded(
            remote=f"{url}/mds",
            local=cache,
            cache_limit=limit,
            shuffle=True,
            shuffle_seed=0,
            shuffle_block_size=WINDOW,
            batch_size=BATCH,
        )
        return StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=default_collate
        )
    if name == "litdata":
        import litdata.streaming.downloader as ldl
        from litdata import StreamingDataLoader, StreamingDataset

        # LitData fetches chunks with obstore, which refuses a plain-http endpoint unless
        # told; the test server speaks http (a configuration, not a speed change).
        ldl._OBSTORE_CLIENT_OPTIONS = {**ldl._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}

        ds = StreamingDataset(
            f"{url}/litdata",
            cache_dir=cache,
            max_cache_size=limit,
            shuffle=True,
            seed=0,
            transform=decode_dict,
            storage_options={"endpoint_url": endpoint},
        )
        return StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=default_collate
        )
    if name == "s3torchconnector":
        from s3torchconnector import S3ClientConfig, S3IterableDataset

        s3ds = S3IterableDataset.from_prefix(
            f"{url}/tar/",
            region="us-east-1",
            endpoint=endpoint,
            s3client_config=S3ClientConfig(force_path_style=True),  # moto on 127.0.0.1
            enable_sharding=True,
        )
        return torch.utils.data.DataLoader(
            _TarSamples(s3ds), batch_size=BATCH, num_workers=WORKERS, collate_fn=default_collate
        )
    raise ValueError(f"unknown loader {name!r}; one of {LOADERS}")


class _TarSamples(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Samples of the tar shards an ``S3IterableDataset`` yields (one S3Reader per object,
    streamed through ``tarfile`` ``r|``), through a shuffle buffer of ``WINDOW`` samples
    seeded per epoch and worker, decoded like every other loader's."""

    def __init__(self, objects: Any) -> None:
        self.objects = objects
        self.epoch = 0

    def _samples(self) -> Any:
        import tarfile

        for obj in self.objects:
            if not obj.key.endswith(".tar"):
                continue  # the index files and dataset.json beside the shards
            cur: dict[str, bytes] = {}
            key = None
            with tarfile.open(fileobj=obj, mode="r|") as tf:
                for m in tf:
                    f = tf.extractfile(m)
                    if f is None:
                        continue
                    k, _, ext = m.name.partition(".")
                    if key is not None and k != key:
                        yield cur
                        cur = {}
                    key = k
                    cur[ext] = f.read()
            if cur:
                yield cur

    def __iter__(self) -> Any:
        import random

        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.epoch * 1000 + (info.id if info else 0))
        buf: list[dict[str, bytes]] = []
        for s in self._samples():
            buf.append(s)
            if len(buf) >= WINDOW:
                j = rng.randrange(len(buf))
                buf[j], buf[-1] = buf[-1], buf[j]
                x = buf.pop()
                yield decode("", x["bin"], x["json"])
        rng.shuffle(buf)
        for x in buf:
            yield decode("", x["bin"], x["json"])


class TreeCPU:
    """CPU seconds of every process in this session (the loader, its DataLoader workers,
    any fetcher), from ``/proc/<pid>/stat`` every 50 ms: the largest utime + stime seen per
    pid, so a worker that exited still counts (up to its last 50 ms). :meth:`total` leaves
    out the CPU of the measuring threads themselves (this sampler and the cache watcher,
    booked into :attr:`own` by the thread that spent it): the measurement is no loader's."""

    def __init__(self) -> None:
        self.sid = os.getsid(0)
        self.tick = os.sysconf("SC_CLK_TCK")
        self.seen: dict[int, float] = {}
        self.own = 0.0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(rest[3]) != self.sid:  # field 6: the session id
                continue
            cpu = (int(rest[11]) + int(rest[12])) / self.tick  # fields 14, 15: utime, stime
            with self.lock:
                self.seen[int(d)] = max(self.seen.get(int(d), 0.0), cpu)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            t0 = time.thread_time()
            self._sample()
            self.book(time.thread_time() - t0)

    def book(self, secs: float) -> None:
        """``secs`` of CPU spent measuring (by the calling thread)."""
        with self.lock:
            self.own += secs

    def total(self) -> float:
        self._sample()
        with self.lock:
            return sum(self.seen.values()) - self.own

    def by_pid(self) -> dict[int, float]:
        with self.lock:
            return dict(self.seen)


def proc_cpu(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads) in seconds; 0 when it is gone."""
    if pid <= 0:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def child(name: str, endpoint: str, limit: int, cache: str) -> dict[str, Any]:
    server = int(os.environ.get("UNBROKEN_BENCH_SERVER_PID", "0"))
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache)
    peak = [0]
    stop = threading.Event()

    events = EventTail(cache if name == "unbroken" else None)

    def watch() -> None:
        # The same share of a core for every loader's measurement (<= 1/(1+WATCH_IDLE)):
        # a walk of unbroken's cache (units, their lock files, readers) costs ~20x one of
        # LitData's few chunk files, and at a fixed 2 ms period it took ~40% of a core from
        # unbroken's run against ~3% from LitData's on this 2-core box (measured: 1.33 vs
        # 0.06 ms of CPU per walk).
        while not stop.is_set():
            t0 = time.thread_time()
            peak[0] = max(peak[0], dir_bytes(cache))
            events.poll()
            spent = time.thread_time() - t0
            cpu.book(spent)
            stop.wait(max(0.002, WATCH_IDLE * spent))

    cpu = TreeCPU()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ld = make_loader(name, endpoint, cache, limit)
    epochs = []
    t_end: dict[int, float] = {}
    for e in range(EPOCHS):
        if name.startswith("unbroken"):
            ld.set_epoch(e)
        if name == "s3torchconnector":
            ld.dataset.epoch = e
        c0 = counts(endpoint)
        cpu0, srv0, fet0 = cpu.total(), proc_cpu(server), proc_cpu(events.fetcher())
        t0 = time.perf_counter()
        ids: list[np.ndarray] = []
        shapes_ok = True
        for batch in ld:
            ids.append(batch["i"].numpy())
            shapes_ok &= (
                tuple(batch["x"].shape[1:]) == (2048,) and batch["x"].dtype == torch.float32
            )
        dt = time.perf_counter() - t0
        cpu1, srv1 = cpu.total(), proc_cpu(server)
        fet1 = proc_cpu(events.fetcher())
        c1 = counts(endpoint)
        seen = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        t_end[e] = time.time()
        epochs.append(
            {
                "seconds": dt,
                "samples": int(seen.size),
                "distinct": int(np.unique(seen).size),
                "samples_per_s": seen.size / dt,
                "bytes_downloaded": c1["get_bytes"] - c0["get_bytes"],
                "gets": c1["gets"] - c0["gets"],
                "cpu_s": cpu1 - cpu0,
                "server_cpu_s": srv1 - srv0,
                "fetcher_cpu_s": fet1 - fet0,  # of cpu_s (unbroken's fetcher process)
                "decoded_ok": bool(shapes_ok),
            }
        )
    stop.set()
    watcher.join()
    cpu.stop.set()
    if name == "unbroken":
        events.poll(force=True)
        keep = os.environ.get("UNBROKEN_BENCH_EVENTS")
        if keep:  # the whole event log and the per-process CPU, to explain an outlier epoch
            with open(keep, "w") as f:
                json.dump({"t_end": t_end, "cpu_by_pid": cpu.by_pid(), "events": events.all()}, f)
        for e, ep in enumerate(epochs):
            ep.update(downloads_by_cause(events.all(), t_end.get(e - 1, 0.0), t_end[e], e))
    out: dict[str, Any] = {"epochs": epochs, "peak_cache_bytes": peak[0]}
    if name == "unbroken":
        out["shuffle_window"] = list(ld.dataset.shuffle_window)
    return out


class EventTail:
    """Every line of unbroken's cache event log (``.events``, rotated to ``.events.1`` at
    ~500 lines: read both often) for :func:`downloads_by_cause`."""

    def __init__(self, cache: str | None) -> None:
        self.cache = cache
        self.lines: dict[str, dict[str, Any]] = {}
        self.last = 0.0

    def poll(self, force: bool = False) -> None:
        if self.cache is None or (not force and time.monotonic() - self.last < 0.1):
            return
        self.last = time.monotonic()
        for fn in (".events.1", ".events"):
            try:
                with open(os.path.join(self.cache, fn)) as f:
                    for line in f:
                        if line.endswith("\n") and line not in self.lines:
                            self.lines[line] = json.loads(line)
            except (OSError, ValueError):
                pass

    def all(self) -> list[dict[str, Any]]:
        return list(self.lines.values())

    def fetcher(self) -> int:
        """The pid of the (latest) fetcher process; 0: none yet."""
        self.poll(force=True)
        pids = [x["pid"] for x in self.all() if x.get("ev") == "fetcher"]
        return int(pids[-1]) if pids else 0


def downloads_by_cause(
    events: list[dict[str, Any]], t0: float, t1: float, e: int
) -> dict[str, Any]:
    """Where the downloads made during epoch ``e`` (between ``t0`` and ``t1``) went, from
    the cache's event log: for this epoch's reads, read-ahead for the next epoch, and
    *re*-downloads (a shard fetched again for the same epoch: evicted before its use); and
    the evictions of shards and of kept index files."""
    evs = sorted((x for x in events if x.get("ev") == "download"), key=lambda x: x["t"])
    done: set[tuple[Any, Any, Any]] = set()
    out = {"dl_units": 0, "dl_next_epoch_bytes": 0, "dl_again_bytes": 0, "dl_again_units": 0}
    for x in evs:
        k = (x.get("dir"), x.get("shard"), x.get("for_epoch"))
        again = k in done
        done.add(k)
        if not t0 < x["t"] <= t1:
            continue
        out["dl_units"] += 1
        if x.get("for_epoch", e) > e:
            out["dl_next_epoch_bytes"] += int(x.get("bytes", 0))
        if again:
            out["dl_again_units"] += 1
            out["dl_again_bytes"] += int(x.get("bytes", 0))
    here = [x for x in events if t0 < x["t"] <= t1]
    out["evictions"] = sum(1 for x in here if x.get("ev") == "evict")
    # an evicted shard keeps its index on the node; these are the kept indexes dropped later
    out["index_drops"] = sum(len(x.get("shards", ())) for x in here if x.get("ev") == "evict_index")
    return out


# --- driver ---------------------------------------------------------------------------------


ANCHORS = ("mosaicml", "litdata", "s3torchconnector")


def _per_gb(ep: dict[str, Any]) -> float:
    """Client CPU-seconds per GB downloaded in one epoch."""
    return float(ep["cpu_s"]) / max(ep["bytes_downloaded"] / 1e9, 1e-9)


def goals(results: dict[str, Any]) -> None:
    """Issue 22's goals, per round and epoch, against the anchors of the same round: samples/s
    >= 1.5x the fastest anchor, client CPU per GB <= 0.5x the leanest anchor's, downloads <=
    1.1x the dataset, the cache never above its limit."""
    ours = results.get("unbroken", {}).get("rounds", [])
    anchors = [n for n in ANCHORS if n in results]
    if not ours or not anchors:
        return
    size, limit = results["unbroken"]["dataset_bytes"], results["unbroken"]["cache_limit"]
    print(
        "\n| round, epoch | unbroken samples/s | best anchor | ratio (goal >= 1.5x) | "
        "CPU per GB vs the leanest anchor (goal <= 0.5x) | downloaded (goal <= 1.1x) |"
    )
    print("|---|---|---|---|---|---|")
    met = {"speed": 0, "cpu": 0, "bytes": 0}
    n = 0
    for rnd, r in enumerate(ours):
        if "epochs" not in r:
            continue
        for e, ep in enumerate(r["epochs"]):
            others = [
                (name, results[name]["rounds"][rnd]["epochs"][e])
                for name in anchors
                if rnd < len(results[name]["rounds"]) and "epochs" in results[name]["rounds"][rnd]
            ]
            if not others:
                continue
            best, fast = max(others, key=lambda x: x[1]["samples_per_s"])
            lean = min(_per_gb(o) for _, o in others)
            speed = ep["samples_per_s"] / fast["samples_per_s"]
            cpu = _per_gb(ep) / lean
            down = ep["bytes_downloaded"] / size
            n += 1
            met["speed"] += speed >= 1.5
            met["cpu"] += cpu <= 0.5
            met["bytes"] += down <= 1.1
            print(
                f"| {rnd}, {e + 1} | {ep['samples_per_s']:,.0f} | {best} "
                f"{fast['samples_per_s']:,.0f} | {speed:.2f}x | {cpu:.2f}x | {down:.2f}x |"
            )
    peak = max(r["peak_cache_bytes"] for r in ours if "epochs" in r)
    print(
        f"\ngoals met in epochs: samples/s {met['speed']} of {n}, CPU per GB {met['cpu']} of "
        f"{n}, downloads {met['bytes']} of {n}; peak cache {peak / 1e6:,.1f} MB of "
        f"{limit / 1e6:,.1f} MB ({'within' if peak <= limit else 'OVER'} the limit)",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--only", nargs="*", default=None, help=f"subset of {LOADERS}")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the loaders (median)")
    ap.add_argument("--prepare-only", action="store_true", help="make the data, then stop")
    ap.add_argument(
        "--events", default=None, help="keep unbroken's cache event log of each round here"
    )
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.update(_CREDS)
    if a.serve:
        serve(a.serve)
        return 0
    if a.child:
        name, endpoint, limit, cache = a.child
        print(json.dumps(child(name, endpoint, int(limit), cache)), flush=True)
        return 0

    fmt = {
        "unbroken": "tar",
        "mosaicml": "mds",
        "litdata": "litdata",
        "s3torchconnector": "tar",
        "unbroken-local": "tar",
    }
    names = list(a.only or LOADERS)
    formats = {fmt[n] for n in names}
    prepare(a.root, formats)
    if a.prepare_only:
        return 0
    port_file = os.path.join(a.root, "port")
    with moto_process(__file__, port_file, {**os.environ, **_CREDS}) as (srv, endpoint):
        t0 = time.perf_counter()
        upload(endpoint, a.root, formats)
        print(f"uploaded to {endpoint} in {time.perf_counter() - t0:.0f} s", flush=True)
        results: dict[str, Any] = {n: {"rounds": []} for n in names}
        for rnd in range(a.rounds):
            # rotate the order each round: a busy box drifts, no loader always goes first
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                size = dir_bytes(f"{a.root}/{fmt[name]}")
                limit = int(size * CACHE_FRAC)
                env = {
                    **os.environ,
                    **_CREDS,
                    "S3_ENDPOINT_URL": endpoint,
                    "AWS_ENDPOINT_URL": endpoint,
                    "UNBROKEN_BENCH_SERVER_PID": str(srv.pid),
                }
                if a.events:
                    os.makedirs(a.events, exist_ok=True)
                    env["UNBROKEN_BENCH_EVENTS"] = os.path.join(a.events, f"round{rnd}-{name}.json")
                r = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        name,
                        endpoint,
                        str(limit),
                        f"{a.root}/cache-{name}",
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=1800,
                    start_new_session=True,  # its session: the processes TreeCPU counts
                )
                if r.returncode != 0:
                    print(f"{name}: failed\n{r.stderr[-4000:]}", flush=True)
                    results[name]["rounds"].append({"error": r.stderr[-2000:]})
                    continue
                res = json.loads(r.stdout.strip().splitlines()[-1])
                results[name].update(dataset_bytes=size, cache_limit=limit)
                results[name]["rounds"].append(res)
                for e, ep in enumerate(res["epochs"]):
                    print(
                        f"round {rnd} {name:>9} epoch {e + 1}: {ep['samples_per_s']:8,.0f} "
                        f"samples/s ({ep['samples']:,} samples, {ep['distinct']:,} distinct, "
                        f"{ep['seconds']:.1f} s), downloaded "
                        f"{ep['bytes_downloaded'] / size:.2f}x its dataset "
                        f"({ep['bytes_downloaded'] / 1e6:,.0f} MB, {ep['gets']} GETs), "
                        f"CPU {ep['cpu_s']:.1f} s "
                        f"({_per_gb(ep):.1f} s/GB), "
                        f"server (moto) CPU {ep.get('server_cpu_s', 0.0):.1f} s"
                        + (
                            f", of the client's: fetcher {ep['fetcher_cpu_s']:.2f} s"
                            if ep.get("fetcher_cpu_s")
                            else ""
                        )
                        + (
                            f"; event log: {ep['dl_units']} units downloaded, "
                            f"{ep['dl_next_epoch_bytes'] / size:.3f}x read ahead for the next "
                            f"epoch, {ep['dl_again_units']} downloaded again "
                            f"({ep['dl_again_bytes'] / size:.3f}x), {ep['evictions']} evictions, "
                            f"{ep.get('index_drops', 0)} kept indexes dropped"
                            if "dl_units" in ep
                            else ""
                        ),
                        flush=True,
                    )
                print(
                    f"round {rnd} {name:>9} peak cache {res['peak_cache_bytes'] / 1e6:,.1f} "
                    f"MB of {limit / 1e6:,.1f} MB limit; dataset {size / 1e6:,.1f} MB"
                    + (
                        f"; shuffle_window {res['shuffle_window']}"
                        if "shuffle_window" in res
                        else ""
                    ),
                    flush=True,
                )
        print("\nmedian over rounds:")
        for name in names:
            ok = [r for r in results[name]["rounds"] if "epochs" in r]
            if not ok:
                continue
            size = results[name]["dataset_bytes"]
            summ = {
                f"epoch{e + 1}_samples_per_s": statistics.median(
                    r["epochs"][e]["samples_per_s"] for r in ok
                )
                for e in range(EPOCHS)
            }
            summ.update(
                {
                    f"epoch{e + 1}_downloaded_x": statistics.median(
                        r["epochs"][e]["bytes_downloaded"] for r in ok
                    )
                    / size
                    for e in range(EPOCHS)
                }
            )
            summ.update(
                {
                    f"epoch{e + 1}_cpu_s": statistics.median(r["epochs"][e]["cpu_s"] for r in ok)
                    for e in range(EPOCHS)
                }
            )
            summ.update(
                {
                    f"epoch{e + 1}_cpu_s_per_gb": statistics.median(
                        _per_gb(r["epochs"][e]) for r in ok
                    )
                    for e in range(EPOCHS)
                }
            )
            summ.update(
                {
                    f"epoch{e + 1}_server_cpu_s": statistics.median(
                        r["epochs"][e].get("server_cpu_s", 0.0) for r in ok
                    )
                    for e in range(EPOCHS)
                }
            )
            summ["peak_cache_mb"] = max(r["peak_cache_bytes"] for r in ok) / 1e6
            summ["cache_limit_mb"] = results[name]["cache_limit"] / 1e6
            results[name]["summary"] = summ
            print(f"{name:>9}: " + ", ".join(f"{k} {v:,.2f}" for k, v in summ.items()))
        goals(results)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
