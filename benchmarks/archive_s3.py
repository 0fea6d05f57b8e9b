"""The checkpoint archive against S3: unbroken's upload and verified download of a committed
step vs s3torchconnector's DCP ``S3StorageWriter`` / ``S3StorageReader`` on the same tensors
(issue 22 item 4).

One committed step of ``--gib`` GiB (a model of random float32 tensors of 256 MiB each, saved
once by ``Checkpointer`` under ``--root`` and kept) and one moto S3 server in its own process on
127.0.0.1 (``data_remote.py``'s, with its byte counter). ``--warmup`` untimed rounds first
(default 1: a fresh server's first upload costs it about twice the CPU of later ones), then
per round, in rotated order:

* ``unbroken.upload``: ``Archive("s3://...").upload(step_dir, step)`` (the step read once
  before, untimed: a just-committed step is in the page cache, as s3torchconnector's tensors
  are in memory): the committed files,
  each hashed (xxh3-128) against the manifest while read, multipart PUTs of 8 MiB parts
  through the object-store layer (obstore), manifest last;
* ``unbroken.download``: ``Archive.download(step, dir)``: each file in at most its share
  of ``threads`` streamed ranged GETs (here: 4 files, 2 ranges each for the two 1 GiB
  shards), every byte hashed in order, fsynced, renamed into place on a match;
* ``s3torchconnector.save``: ``torch.distributed.checkpoint.save(state_dict,
  storage_writer=S3StorageWriter(region, "s3://...", thread_count=8))`` of the same tensors;
* ``s3torchconnector.load``: ``dcp.load`` of them back through ``S3StorageReader`` into
  preallocated tensors (no checksum: DCP reads what the store returns).

s3torchconnector's DCP classes take no endpoint: their CRT client is replaced by one built with
``endpoint=`` and ``force_path_style`` (a configuration, not a speed change). Per operation:
wall seconds, GB/s, client CPU seconds (``time.process_time``: every thread of this process)
and server CPU seconds (``/proc/<pid>/stat``), bytes the server sent or received.

Run from the anchor venv, from the repository root, under the bench lock (``tenacity`` for
s3torchconnector.dcp: ``pip install --target /tmp/unbroken-bench-extra tenacity``):

    flock /tmp/unbroken-bench.lock env PYTHONPATH=$PWD/src:/tmp/unbroken-bench-extra \\
        /work/main/.venv-bench/bin/python benchmarks/archive_s3.py --gib 2 --rounds 2
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
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _moto import moto_process
from data_remote import _CREDS, counts

BUCKET = "ckptbench"
PART = 256 << 20  # bytes per tensor
OPS = ("unbroken.upload", "unbroken.download", "s3torchconnector.save", "s3torchconnector.load")


def make_state(gib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, int(gib * (1 << 30)) // PART)
    return {f"w{i}": torch.randn(PART // 4, generator=g) for i in range(n)}


class _Weights(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in tensors.items():
            self.register_buffer(k, v)


def committed_step(root: str, gib: float) -> tuple[str, dict[str, torch.Tensor]]:
    """A committed local step of ``gib`` GiB under ``root`` (made once, then reused)."""
    from unbroken.ckpt import Checkpointer, TrainState

    tensors = make_state(gib)
    ck_root = os.path.join(root, f"ckpt-{gib}")
    step_dir = os.path.join(ck_root, "step-00000001")
    if not os.path.exists(os.path.join(step_dir, "manifest.json")):
        shutil.rmtree(ck_root, ignore_errors=True)
        st = TrainState(model=_Weights(tensors), capture_rng=False)
        st.step = 1
        Checkpointer(ck_root, st, keep_last=None).save()
    return step_dir, tensors


def server_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def crt_client(endpoint: str) -> Any:
    from s3torchconnector._s3client import S3Client, S3ClientConfig

    return S3Client(
        "us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
    )


def ops(
    endpoint: str, step_dir: str, tensors: dict[str, torch.Tensor], work: str, rnd: int
) -> dict[str, Callable[[], int]]:
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    from unbroken.ckpt.archive.remote import Archive

    so = {"client_kwargs": {"endpoint_url": endpoint}}
    arch = Archive(f"s3://{BUCKET}/unbroken-{rnd}", storage_options=so)
    dcp_url = f"s3://{BUCKET}/dcp-{rnd}"
    total = sum(t.numel() * t.element_size() for t in tensors.values())

    def upload() -> int:
        arch.upload(step_dir, 1)
        return total

    def warm() -> None:
        # s3torchconnector saves tensors from memory; a just-committed step is in the page
        # cache too: read it once before the timed upload so neither side waits on the disk
        for name in os.listdir(step_dir):
            with open(os.path.join(step_dir, name), "rb") as f:
                while f.read(64 << 20):
                    pass

    def download() -> int:
        dest = tempfile.mkdtemp(dir=work)
        try:
            arch.download(1, dest, progress=False)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        return total

    def save() -> int:
        w = S3StorageWriter("us-east-1", dcp_url, thread_count=arch.config.threads)
        w.fs._client = crt_client(endpoint)
        dcp.save({"model": tensors}, storage_writer=w)
        return total

    def load() -> int:
        out = {"model": {k: torch.empty_like(v) for k, v in tensors.items()}}
        r = S3StorageReader("us-east-1", dcp_url)
        r.fs._client = crt_client(endpoint)
        dcp.load(out, storage_reader=r)
        if not all(torch.equal(out["model"][k], v) for k, v in tensors.items()):
            raise RuntimeError("s3torchconnector.load: tensors differ from what was saved")
        return total

    warm()
    return {
        "unbroken.upload": upload,
        "unbroken.download": download,
        "s3torchconnector.save": save,
        "s3torchconnector.load": load,
    }


def run_round(
    endpoint: str,
    server_pid: int,
    step_dir: str,
    tensors: dict[str, torch.Tensor],
    work: str,
    rnd: int,
    results: dict[str, list[dict[str, float]]],
) -> None:
    """Each operation once: uploads before downloads (those read what the uploads wrote),
    the two clients' order rotated per round."""
    table = ops(endpoint, step_dir, tensors, work, rnd)
    pairs = [("unbroken.upload", "s3torchconnector.save")]
    pairs += [("unbroken.download", "s3torchconnector.load")]
    for first, second in pairs:
        for op in (first, second) if rnd % 2 == 0 else (second, first):
            c0, s0, p0 = counts(endpoint), server_cpu(server_pid), time.process_time()
            t0 = time.perf_counter()
            n = table[op]()
            dt = time.perf_counter() - t0
            p1, s1, c1 = time.process_time(), server_cpu(server_pid), counts(endpoint)
            r = {
                "seconds": dt,
                "gb_per_s": n / 1e9 / dt,
                "client_cpu_s": p1 - p0,
                "server_cpu_s": s1 - s0,
                "requests": c1["requests"] - c0["requests"],
                "get_bytes": c1["get_bytes"] - c0["get_bytes"],
            }
            results[op].append(r)
            print(
                f"round {rnd} {op:>22}: {dt:6.2f} s, {r['gb_per_s']:.2f} GB/s, client "
                f"CPU {r['client_cpu_s']:.1f} s, server CPU {r['server_cpu_s']:.1f} s, "
                f"{r['requests']} requests",
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/tmp/unbroken-bench-archive")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds first (both clients, every operation): the fresh server's first "
        "upload cost it ~2x the CPU of later ones, and round 0 always gave it to one client",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.update(_CREDS)
    os.makedirs(a.root, exist_ok=True)
    step_dir, tensors = committed_step(a.root, a.gib)
    here = os.path.dirname(os.path.abspath(__file__))
    results: dict[str, list[dict[str, float]]] = {op: [] for op in OPS}
    script = os.path.join(here, "data_remote.py")
    port_file = os.path.join(a.root, "port")
    with moto_process(script, port_file, {**os.environ, **_CREDS}) as (server, endpoint):
        import s3fs

        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir(BUCKET)
        for w in range(a.warmup):  # warm-up for all: not recorded
            print(f"warm-up round {w + 1} of {a.warmup} (not counted):", flush=True)
            scratch: dict[str, list[dict[str, float]]] = {op: [] for op in OPS}
            run_round(endpoint, server.pid, step_dir, tensors, a.root, -1 - w, scratch)
        for rnd in range(a.rounds):
            run_round(endpoint, server.pid, step_dir, tensors, a.root, rnd, results)
    print(f"\nmedian over {a.rounds} rounds, {a.gib} GiB:")
    for op in OPS:
        v = results[op]
        print(
            f"{op:>22}: {statistics.median(x['seconds'] for x in v):.2f} s, "
            f"{statistics.median(x['gb_per_s'] for x in v):.2f} GB/s, client CPU "
            f"{statistics.median(x['client_cpu_s'] for x in v):.1f} s, server CPU "
            f"{statistics.median(x['server_cpu_s'] for x in v):.1f} s"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
