"""`stage`: local and real-S3 (moto server on 127.0.0.1 + s3fs) copies, checksum failures,
skip-if-valid, free-space check, LOCAL_RANK coordination and resume after SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from unbroken.data.manifest import DatasetManifest
from unbroken.data.prepare.pack import pack
from unbroken.data.prepare.stage import MARKER_NAME, stage


def _dataset(root: str, n: int = 200, shard_size: int = 40_000) -> DatasetManifest:
    rng = np.random.default_rng(n)
    samples = (
        {"__key__": f"s{i:05d}", "bin": rng.bytes(int(rng.integers(1, 3000)))} for i in range(n)
    )
    return pack(samples, root, shard_size=shard_size, fsync=False, progress=False).manifest


def _same(a: str, b: str, m: DatasetManifest) -> bool:
    names = ["dataset.json"] + [s.name for s in m.shards] + [s.index for s in m.shards]
    return all(
        open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read()
        for n in names
    )


def _flip(path: str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_local_stage_verifies_skips_and_refetches(tmp_path: str) -> None:
    src, dst = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "dst")
    m = _dataset(src)
    r = stage(src, dst, workers=4, progress=False)
    assert r.files_copied == 2 * len(m.shards) and r.bytes_copied == m.total_bytes
    assert r.seconds > 0 and r.gb_per_s > 0 and _same(src, dst, m)
    assert open(os.path.join(dst, MARKER_NAME)).read() == m.fingerprint
    again = stage(f"file://{src}", dst, progress=False)
    assert (again.files_copied, again.files_skipped) == (0, 2 * len(m.shards))
    _flip(os.path.join(dst, m.shards[1].name))  # local bit rot: detected and re-fetched
    os.unlink(os.path.join(dst, m.shards[2].index))
    fixed = stage(src, dst, progress=False)
    assert fixed.files_copied == 2 and _same(src, dst, m)


def test_a_newer_version_staged_over_an_older_one_leaves_no_shard_of_the_old(
    tmp_path: str,
) -> None:
    """Re-staging an updated dataset into the same directory is the usual workflow: the old
    version's shards that the new one does not list go (they held disk space, and looked
    like part of the dataset); a file the old manifest did not list is not ours and stays."""
    old, new, dst = (os.path.join(tmp_path, n) for n in ("old", "new", "dst"))
    m_old, m_new = _dataset(old, n=400), _dataset(new, n=100)
    assert len(m_old.shards) > len(m_new.shards)
    stage(old, dst, progress=False)
    with open(os.path.join(dst, "notes.txt"), "w") as f:
        f.write("mine")
    stage(new, dst, progress=False)
    want = {s.name for s in m_new.shards} | {s.index for s in m_new.shards}
    assert set(os.listdir(dst)) == want | {"dataset.json", MARKER_NAME, "notes.txt"}
    assert _same(new, dst, m_new)


def test_corrupt_source_is_reported_naming_the_file(tmp_path: str) -> None:
    src, dst = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "dst")
    m = _dataset(src)
    _flip(os.path.join(src, m.shards[3].name))
    with pytest.raises(
        RuntimeError, match=rf"{m.shards[3].name}: checksum mismatch after 2 fetches"
    ):
        stage(src, dst, retries=1, progress=False)
    assert not os.path.exists(os.path.join(dst, m.shards[3].name))  # never published
    assert not os.path.exists(os.path.join(dst, "dataset.json"))
    assert not os.path.exists(os.path.join(dst, MARKER_NAME))
    assert not [n for n in os.listdir(dst) if n.startswith(".tmp-")]


def test_free_space_checked_before_copying(tmp_path: str) -> None:
    src = os.path.join(tmp_path, "src")
    _dataset(src)
    mnt = os.path.join(tmp_path, "mnt")
    os.makedirs(mnt)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", mnt], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        with pytest.raises(
            RuntimeError, match=rf"{mnt}: staging .* needs [\d,]+ bytes but only [\d,]+ are free"
        ):
            stage(src, mnt, progress=False)
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", mnt], check=False)


def test_free_space_message_without_tmpfs(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "dst")
    m = _dataset(src)
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(
        RuntimeError, match=rf"needs {m.total_bytes:,} bytes but only 1,000 are free"
    ):
        stage(src, dst, progress=False)


def _to_memory_fs(local: str, name: str) -> str:
    """Copy a dataset into fsspec's in-memory filesystem: a non-local source (streamed path)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for n in os.listdir(local):
        fs.pipe_file(f"/{name}/{n}", open(os.path.join(local, n), "rb").read())
    return f"memory://{name}"


def test_stream_source_and_disk_full_during_staging(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The space check passed but the disk fills up mid-copy (another job wrote there)."""
    import errno

    from unbroken.common.objstore import base

    src = os.path.join(tmp_path, "src")
    m = _dataset(src)
    url = _to_memory_fs(src, "ds-full")
    ok = stage(url, os.path.join(tmp_path, "ok"), workers=2, progress=False)
    assert ok.files_copied == 2 * len(m.shards) and _same(src, os.path.join(tmp_path, "ok"), m)
    orig = base.pwrite_all
    written = [0]

    def write(fd: int, b: Any, offset: int) -> None:  # the layer's one write of a GET's bytes
        written[0] += memoryview(b).nbytes
        if written[0] > 100_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        orig(fd, b, offset)

    monkeypatch.setattr(base, "pwrite_all", write)
    dst = os.path.join(tmp_path, "dst")
    with pytest.raises(RuntimeError, match=r"dst/.*: disk full while staging.*re-run"):
        stage(url, dst, workers=2, progress=False)
    names = os.listdir(dst)
    assert "dataset.json" not in names and MARKER_NAME not in names
    assert not [n for n in names if n.startswith(".tmp-")]


def test_real_enospc_on_a_tiny_tmpfs(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    src = os.path.join(tmp_path, "src")
    _dataset(src)
    mnt = os.path.join(tmp_path, "mnt")
    os.makedirs(mnt)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", mnt], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        real = shutil.disk_usage  # claim room, as if another job filled the disk afterwards
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10**12))
        with pytest.raises(RuntimeError, match=rf"{mnt}/.*: disk full while staging"):
            stage(src, mnt, workers=1, progress=False)
        names = os.listdir(mnt)
        assert "dataset.json" not in names and MARKER_NAME not in names
        assert not [n for n in names if n.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", mnt], check=False)


_STAGE_CHILD = r"""
import os, sys
from unbroken.data.prepare.stage import stage
r = stage(sys.argv[1], sys.argv[2], ranks_local=True, progress=False, wait_timeout=60)
print(r.waited, r.files_copied)
"""


def test_ranks_local_only_rank0_copies(tmp_path: str) -> None:
    src, dst = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "dst")
    m = _dataset(src)
    procs = []
    for rank in (2, 1, 0):  # waiters start first
        env = {**os.environ, "LOCAL_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _STAGE_CHILD, src, dst],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outs = [p.communicate(timeout=60)[0].decode().split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outs == [["True", "0"], ["True", "0"], ["False", str(2 * len(m.shards))]]
    assert _same(src, dst, m)


def test_waiting_rank_times_out_with_a_clear_error(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = os.path.join(tmp_path, "src")
    _dataset(src, n=10)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="local rank 0 did not finish staging .* within 0s"):
        stage(
            src, os.path.join(tmp_path, "dst"), ranks_local=True, wait_timeout=0.2, progress=False
        )


def test_a_waiting_rank_does_not_follow_a_planted_marker(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 20 item 4 (staging): the completion marker is a fixed name; a symlink planted
    there (to a file that holds the fingerprint) is not taken for rank 0's marker."""
    src = os.path.join(tmp_path, "src")
    m = _dataset(src, n=10)
    dst = os.path.join(tmp_path, "dst")
    os.makedirs(dst)
    elsewhere = os.path.join(tmp_path, "elsewhere")
    with open(elsewhere, "w") as f:
        f.write(m.fingerprint)
    os.symlink(elsewhere, os.path.join(dst, MARKER_NAME))
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="local rank 0 did not finish staging"):
        stage(src, dst, ranks_local=True, wait_timeout=0.3, progress=False)


_SLOW_STAGE = r"""
import sys, time
import unbroken.data.prepare.stage as st
orig = st._copy_one
def slow(*a, **k):
    orig(*a, **k)
    time.sleep(0.15)
st._copy_one = slow
st.stage(sys.argv[1], sys.argv[2], workers=1, progress=False)
"""


def test_stage_resumes_after_sigkill(tmp_path: str) -> None:
    src, dst = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "dst")
    m = _dataset(src, n=300, shard_size=30_000)
    p = subprocess.Popen([sys.executable, "-c", _SLOW_STAGE, src, dst], start_new_session=True)
    t0 = time.monotonic()
    names = {s.name for s in m.shards} | {s.index for s in m.shards}
    while len(names & set(os.listdir(dst) if os.path.isdir(dst) else [])) < 4:
        assert p.poll() is None and time.monotonic() - t0 < 60, "stage child ended or stalled"
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not os.path.exists(os.path.join(dst, MARKER_NAME))
    r = stage(src, dst, progress=False)
    assert r.files_skipped >= 4 and r.files_copied >= 1
    assert _same(src, dst, m) and not [n for n in os.listdir(dst) if n.startswith(".tmp-")]


# --- a real S3 endpoint ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds).create_bucket(
        Bucket="data"
    )
    opts = {
        "key": "testing",
        "secret": "testing",
        "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    yield opts
    server.stop()


def _upload(opts: dict[str, Any], local: str, prefix: str) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    for n in os.listdir(local):
        if not n.startswith("."):
            fs.put_file(os.path.join(local, n), f"data/{prefix}/{n}")
    return fs


def test_stage_from_s3(tmp_path: str, s3: dict[str, Any]) -> None:
    src = os.path.join(tmp_path, "src")
    m = _dataset(src)
    _upload(s3, src, "ok")
    dst = os.path.join(tmp_path, "dst")
    r = stage("s3://data/ok", dst, workers=4, progress=False, storage_options=s3)
    assert r.files_copied == 2 * len(m.shards) and _same(src, dst, m)
    _flip(os.path.join(dst, m.shards[0].name))  # damaged local copy: re-fetched from S3
    r = stage("s3://data/ok", dst, progress=False, storage_options=s3)
    assert r.files_copied == 1 and _same(src, dst, m)


def test_corrupted_s3_object_is_reported(tmp_path: str, s3: dict[str, Any]) -> None:
    src = os.path.join(tmp_path, "src")
    m = _dataset(src)
    fs = _upload(s3, src, "bad")
    bad = bytearray(open(os.path.join(src, m.shards[2].name), "rb").read())
    bad[500] ^= 1
    fs.pipe_file(f"data/bad/{m.shards[2].name}", bytes(bad))
    dst = os.path.join(tmp_path, "dst")
    with pytest.raises(RuntimeError, match=rf"s3://data/bad/{m.shards[2].name}: checksum mismatch"):
        stage("s3://data/bad", dst, progress=False, storage_options=s3)
    assert not os.path.exists(os.path.join(dst, m.shards[2].name))
    assert not os.path.exists(os.path.join(dst, "dataset.json"))


def test_an_s3_object_longer_or_shorter_than_the_manifest_says_is_reported(
    tmp_path: str, s3: dict[str, Any]
) -> None:
    # A whole small file is read with one ranged GET (one byte past the manifest's size):
    # an object that grew must fail the size check, not be cut to the expected length.
    import s3fs

    from unbroken.common.objstore import open_store
    from unbroken.data.prepare.stage import fetch_verified

    src = os.path.join(tmp_path, "src")
    m = _dataset(src)
    fs = _upload(s3, src, "sizes")
    assert isinstance(fs, s3fs.S3FileSystem)
    store = open_store("s3://data/sizes", s3)  # issue 22 item 2: the object-store layer
    assert store.kind == "obstore"
    s = m.shards[1]
    good = open(os.path.join(src, s.name), "rb").read()
    dst = os.path.join(tmp_path, s.name)
    for label, body in (("longer", good + b"\0"), ("shorter", good[:-1])):
        fs.pipe_file(f"data/sizes/{s.name}", body)
        with pytest.raises(RuntimeError, match=rf"{s.name}: checksum mismatch .*got {len(body)} "):
            fetch_verified(store, s.name, dst, s.bytes, s.checksum, retries=0)
        assert not os.path.exists(dst), label
    fs.pipe_file(f"data/sizes/{s.name}", good)
    fetch_verified(store, s.name, dst, s.bytes, s.checksum, retries=0)
    assert open(dst, "rb").read() == good
