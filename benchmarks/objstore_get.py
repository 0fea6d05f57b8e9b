"""What one GET costs: s3fs vs obstore (sync, async) vs unbroken's object-store layer vs
s3torchconnector's CRT client, against one moto S3 server (issue 22 item 1).

The server runs in its own process on 127.0.0.1 (moto's werkzeug app, threaded), so the
client's CPU (this process: ``time.process_time``, every thread) and the server's CPU
(``/proc/<pid>/stat``) are measured apart. Objects of 256 KiB, 4 MiB and 64 MiB; for each
size every client does ``--gets`` GETs one after another (per-request cost, not throughput
under concurrency), in ``--rounds`` rounds whose client order is rotated (a busy box drifts;
no client always goes first). Per GET: wall ms, client CPU ms, server CPU ms.

Clients (each GET asks for the whole object; "mem" ends in memory, "file" in a new local
file, unlinked right after inside the timing, as a cache writes new files and evicts old ones):

* ``s3fs.cat_file``  mem: one ranged GET to size + 1, what ``data stage`` does today
* ``s3fs.get_file``  file: s3fs's own download (HEAD + GET)
* ``obstore.sync``   mem: ``obstore.get_range(store, key, start=0, end=size + 1)``
* ``obstore.async``  mem: ``get_range_async`` on one persistent event loop
* ``unbroken``       file: ``ObjectStore.get_file``: verified (size + xxh3-128), one streamed
  GET below 2 x ``split_bytes`` (128 MiB), pwrite into a temp file, rename (``StoreOptions()``
  defaults)
* ``unbroken.split`` file: the same with ``split_bytes=8 MiB``: 8 MiB ranges, 8 at a time
  (round 1's default), to show what splitting costs against moto (which reads the whole
  object for every ranged GET)
* ``unbroken.fsspec`` file: the same layer on s3fs (``StoreOptions(client='fsspec')``)
* ``s3torchconnector`` mem: ``S3Client(region, endpoint=...).get_object(b, k).read()``

Run from the anchor venv (s3torchconnector lives there), from the repository root:

    flock /tmp/unbroken-bench.lock env PYTHONPATH=$PWD/src \\
        /work/main/.venv-bench/bin/python benchmarks/objstore_get.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _moto import moto_process

BUCKET = "objbench"
SIZES = {"256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}
CLIENTS = (
    "s3fs.cat_file",
    "s3fs.get_file",
    "obstore.sync",
    "obstore.async",
    "unbroken",
    "unbroken.split",
    "unbroken.fsspec",
    "s3torchconnector",
)
_CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


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
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(port_file + ".tmp", port_file)
    server.serve_forever()


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_clients(endpoint: str, tmp: str) -> dict[str, Callable[[str, int], Any]]:
    import obstore
    import s3fs
    from obstore.store import S3Store

    from unbroken.common.fs import checksum_file
    from unbroken.common.objstore import StoreOptions, open_store

    so = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    # botocore's response CRC off, as the node cache configures s3fs today
    so_cache = {**so, "config_kwargs": {"response_checksum_validation": "when_required"}}
    fs = s3fs.S3FileSystem(**so_cache)
    ob = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True})
    loop = asyncio.new_event_loop()
    layer = open_store(f"s3://{BUCKET}", so)
    layer_fs = open_store(f"s3://{BUCKET}", so_cache, StoreOptions(client="fsspec"))
    layer_split = open_store(f"s3://{BUCKET}", so, StoreOptions(split_bytes=8 << 20))
    assert layer.kind == "obstore" and layer_fs.kind == "fsspec"
    sums: dict[str, str] = {}

    def digest(key: str) -> str:
        if key not in sums:
            p = os.path.join(tmp, "ref")
            fs.get_file(f"{BUCKET}/{key}", p)
            sums[key] = checksum_file(p)[1]
        return sums[key]

    async def aget(k: str, n: int) -> Any:
        return await obstore.get_range_async(ob, k, start=0, end=n + 1)

    seq = iter(range(1 << 62))

    def to_file(get: Callable[[str], Any]) -> None:
        p = os.path.join(tmp, f"dst-{next(seq)}")  # a new file, as a cache writes
        get(p)
        os.unlink(p)

    clients: dict[str, Callable[[str, int], Any]] = {
        "s3fs.cat_file": lambda k, n: fs.cat_file(f"{BUCKET}/{k}", start=0, end=n + 1),
        "s3fs.get_file": lambda k, n: to_file(lambda p: fs.get_file(f"{BUCKET}/{k}", p)),
        "obstore.sync": lambda k, n: obstore.get_range(ob, k, start=0, end=n + 1),
        "obstore.async": lambda k, n: loop.run_until_complete(aget(k, n)),
        "unbroken": lambda k, n: to_file(
            lambda p: layer.get_file(k, p, size=n, checksum=digest(k))
        ),
        "unbroken.split": lambda k, n: to_file(
            lambda p: layer_split.get_file(k, p, size=n, checksum=digest(k))
        ),
        "unbroken.fsspec": lambda k, n: to_file(
            lambda p: layer_fs.get_file(k, p, size=n, checksum=digest(k))
        ),
    }
    try:
        from s3torchconnector._s3client import S3Client, S3ClientConfig

        crt = S3Client(
            "us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
        )
        first = next(iter(SIZES))
        crt.get_object(BUCKET, first).read()  # can it talk to moto over plain http at all?
        clients["s3torchconnector"] = lambda k, n: crt.get_object(BUCKET, k).read()
    except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
        print(f"s3torchconnector: cannot GET from {endpoint}: {type(e).__name__}: {e}")
    for k in SIZES:
        digest(k)
    return clients


def run(endpoint: str, server_pid: int, gets: dict[str, int], rounds: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="unbroken-objbench-")
    try:
        clients = make_clients(endpoint, tmp)
        res: dict[str, Any] = {}
        for label, size in SIZES.items():
            names = list(clients)
            acc = {c: [0.0, 0.0, 0.0, 0] for c in names}
            per_round = max(1, gets[label] // rounds)
            for rnd in range(rounds):
                order = names[rnd % len(names) :] + names[: rnd % len(names)]
                for c in order:
                    fn = clients[c]
                    fn(label, size)  # warm: connection pool, first-use imports
                    s0, c0, w0 = proc_cpu(server_pid), time.process_time(), time.perf_counter()
                    for _ in range(per_round):
                        r = fn(label, size)
                        del r
                    w1, c1, s1 = time.perf_counter(), time.process_time(), proc_cpu(server_pid)
                    a = acc[c]
                    a[0] += w1 - w0
                    a[1] += c1 - c0
                    a[2] += s1 - s0
                    a[3] += per_round
            res[label] = {
                c: {
                    "gets": a[3],
                    "wall_ms": 1e3 * a[0] / a[3],
                    "client_cpu_ms": 1e3 * a[1] / a[3],
                    "server_cpu_ms": 1e3 * a[2] / a[3],
                    "client_cpu_s_per_gb": a[1] / (a[3] * size / 1e9),
                }
                for c, a in acc.items()
            }
            print(f"{label}: done", flush=True)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def table(res: dict[str, Any]) -> str:
    lines = [
        "| object | client | GETs | wall ms/GET | client CPU ms/GET | server CPU ms/GET | "
        "client CPU s/GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, per in res.items():
        for c, r in per.items():
            lines.append(
                f"| {label} | {c} | {r['gets']} | {r['wall_ms']:.2f} | {r['client_cpu_ms']:.2f} "
                f"| {r['server_cpu_ms']:.2f} | {r['client_cpu_s_per_gb']:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gets", type=int, default=200, help="GETs per client and size")
    ap.add_argument("--gets-64mib", type=int, default=None, help="override for 64 MiB")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (client order rotated)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.update(_CREDS)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL"):
        os.environ.pop(k, None)
    if a.serve:
        serve(a.serve)
        return 0
    gets = {k: a.gets for k in SIZES}
    if a.gets_64mib is not None:
        gets["64MiB"] = a.gets_64mib
    port_file = tempfile.mktemp(prefix="unbroken-objbench-port-")
    with moto_process(__file__, port_file) as (server, endpoint):
        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
        fs.mkdir(BUCKET)
        for label, size in SIZES.items():
            fs.pipe_file(f"{BUCKET}/{label}", os.urandom(size))
        load0 = os.getloadavg()
        t0 = time.time()
        res = run(endpoint, server.pid, gets, a.rounds)
        load1 = os.getloadavg()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(port_file)
    head = (
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(t0))}, "
        f"{time.time() - t0:.0f} s; load average {load0[0]:.2f} / {load0[1]:.2f} / "
        f"{load0[2]:.2f} at the start, {load1[0]:.2f} / {load1[1]:.2f} / {load1[2]:.2f} "
        f"at the end; {os.cpu_count()} CPUs"
    )
    print(head)
    print(table(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"head": head, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
