"""Pre-flight checks against real storage states: a directory, a file in its place, a FIFO
that blocks the probe like a hung mount, a full disk threshold, a damaged dataset, a closed
port; and `unbroken run` refusing to start while pre-flight fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import elastic_harness as h
import pytest

from rankkit import reserved_port
from unbroken.common.events import load_events
from unbroken.elastic.preflight import PreflightConfig, run_preflight, wait_until_healthy

pytestmark = pytest.mark.timeout(120)


def _check(cfg: PreflightConfig, name: str):
    (r,) = [r for r in run_preflight(cfg) if r.name == name]
    return r


def test_ckpt_dir_probe_ok_then_broken_by_a_file(tmp_path):
    d = tmp_path / "ckpt"
    r = _check(PreflightConfig(ckpt_dir=str(d), node="n1"), "ckpt_dir")
    assert r.ok and "writable" in r.detail and d.is_dir()
    assert os.listdir(d) == []  # the probe file is gone again
    d.rmdir()
    d.write_text("x")
    r = _check(PreflightConfig(ckpt_dir=str(d), node="n1"), "ckpt_dir")
    assert not r.ok and "FileExistsError" in r.detail


def test_a_vanished_ckpt_dir_of_a_run_that_saved_is_an_outage_not_a_fresh_start(tmp_path):
    """Once the run has saved, a missing checkpoint directory (storage not mounted, or moved
    back a moment later: the drill's storage fault lost this race, the probe made an empty
    one and the job silently started again from step 0) fails the check and is not made;
    before the first save the directory is created as before."""
    d = tmp_path / "ckpt"
    r = _check(PreflightConfig(ckpt_dir=str(d), node="n1", saved=True), "ckpt_dir")
    assert not r.ok and not d.exists(), r
    assert str(d) in r.detail and "saved" in r.detail and "step 0" in r.detail, r.detail
    r = _check(PreflightConfig(ckpt_dir=str(d), node="n1"), "ckpt_dir")
    assert r.ok and d.is_dir()
    r = _check(PreflightConfig(ckpt_dir=str(d), node="n1", saved=True), "ckpt_dir")
    assert r.ok, r  # present: the probe runs as before


def test_hung_probe_is_cut_off_by_its_timeout(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    os.mkfifo(d / ".unbroken-probe-n1")  # open() for writing blocks: no reader, ever
    t0 = time.monotonic()
    r = _check(PreflightConfig(ckpt_dir=str(d), node="n1", timeout=1.0), "ckpt_dir")
    assert time.monotonic() - t0 < 3.0
    assert not r.ok and "timed out after 1 s" in r.detail
    # another node's probe name is not affected
    assert _check(PreflightConfig(ckpt_dir=str(d), node="n2", timeout=5.0), "ckpt_dir").ok


def test_free_space_must_fit_one_more_checkpoint(tmp_path):
    r = _check(PreflightConfig(ckpt_dir=str(tmp_path), min_free_bytes=1 << 60), "ckpt_dir")
    assert not r.ok and "MiB needed for one more checkpoint" in r.detail
    big = tmp_path / "step-00000007"
    big.mkdir()
    with open(big / "blob", "wb") as f:
        f.truncate(1 << 43)  # sparse: an 8 TiB "checkpoint" costs no disk
    r = _check(PreflightConfig(ckpt_dir=str(tmp_path), min_free_bytes=0), "ckpt_dir")
    assert not r.ok and "newest 8388608 MiB" in r.detail


def test_only_names_the_checkpointer_writes_are_steps_to_make_room_for(tmp_path):
    """`step-²` (isdigit, not int) and `step-9` (not `step-%08d`) are someone else's: no
    probe crash, and their bytes are not one more checkpoint's."""
    for name in ("step-\u00b2", "step-9"):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "blob", "wb") as f:
            f.truncate(1 << 43)
    r = _check(PreflightConfig(ckpt_dir=str(tmp_path), min_free_bytes=0), "ckpt_dir")
    assert r.ok, r.detail


def test_dataset_manifest_checked_against_the_shards(tmp_path):
    from unbroken.data.prepare.pack import pack

    out = str(tmp_path / "ds")
    samples = ({"__key__": f"s{i:04d}", "bin": os.urandom(500)} for i in range(40))
    pack(samples, out, shard_size=12_000, workers=1, fsync=False, progress=False)
    r = _check(PreflightConfig(data=out), "data")
    assert r.ok, r.detail
    manifest = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    shard = os.path.join(out, manifest["shards"][1]["name"])
    with open(shard, "r+b") as f:
        f.truncate(100)
    r = _check(PreflightConfig(data=out), "data")
    assert not r.ok and manifest["shards"][1]["name"] in r.detail and "manifest says" in r.detail
    assert not _check(PreflightConfig(data=str(tmp_path / "nope")), "data").ok


def test_rendezvous_endpoint_must_accept_connections():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert _check(
            PreflightConfig(rdzv_endpoint=f"127.0.0.1:{port}", timeout=2), "rendezvous"
        ).ok
    # Bound but never listening: refused, and no other process can start listening on it
    # meanwhile (a closed port can be taken before the check connects: task "ports").
    with reserved_port() as port:
        r = _check(PreflightConfig(rdzv_endpoint=f"127.0.0.1:{port}", timeout=2), "rendezvous")
    assert not r.ok and "refused" in r.detail.lower()


def test_gpu_check_reads_nvidia_smi(tmp_path, monkeypatch):
    # No GPU on the CI machine: a stand-in nvidia-smi prints what the real one prints for
    # `--query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '0, 1, 81559\\n1, 40000, 81559\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = _check(PreflightConfig(gpus=2), "gpus")
    assert not r.ok and "GPU 1: 40000 of 81559 MiB in use" in r.detail
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert _check(PreflightConfig(gpus=1), "gpus").ok
    r = _check(PreflightConfig(gpus=2), "gpus")
    assert not r.ok and "1 GPUs visible, 2 needed" in r.detail


def test_wait_until_healthy_backs_off_then_succeeds(tmp_path):
    d = tmp_path / "ckpt"
    d.write_text("x")
    seen: list[bool] = []

    def on_result(res, waited):
        seen.append(all(r.ok for r in res))
        if len(seen) == 2:
            d.unlink()  # storage comes back

    ok, _ = wait_until_healthy(
        PreflightConfig(ckpt_dir=str(d)), max_wait=20, initial_delay=0.1, on_result=on_result
    )
    assert ok and seen == [False, False, True]
    ok, res = wait_until_healthy(
        PreflightConfig(ckpt_dir=str(tmp_path / "f" / "x"), min_free_bytes=1 << 60),
        max_wait=0.3,
        initial_delay=0.1,
    )
    assert not ok and not res[0].ok


def test_cli_preflight_exit_codes(tmp_path):
    cmd = [sys.executable, "-m", "unbroken.cli", "preflight", "--ckpt-dir"]
    good = subprocess.run([*cmd, str(tmp_path / "c")], capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and "ok    ckpt_dir" in good.stdout
    (tmp_path / "f").write_text("x")
    bad = subprocess.run([*cmd, str(tmp_path / "f")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "FAIL  ckpt_dir" in bad.stdout


def test_run_never_starts_while_preflight_fails(tmp_path):
    blocked = tmp_path / "ckpt"
    blocked.write_text("not a directory")
    with h.jobs() as start:
        job = start(
            str(tmp_path / "run"),
            ["--ckpt-dir", str(blocked), "--preflight-max-wait", "1.5"],
            ["--ckpt", str(blocked), "--metrics", str(tmp_path / "m.jsonl")],
        )
        assert job.wait(60) == 6, job.output()[-2000:]
        assert not h.pids_of(job), h.described(h.pids_of(job))  # the early agent closed
    events = load_events(job.run_dir)
    checks = [e for e in events if e["event"] == "preflight"]
    assert len(checks) >= 2 and not any(e["ok"] for e in checks)
    assert not [e for e in events if e["event"] == "launch"]
    assert "pre-flight failed" in job.output()


def test_a_remote_dataset_is_checked_through_the_object_store(tmp_path, monkeypatch):
    """``unbroken run --data s3://bucket/ds``: the manifest is read and every shard's size
    listed through the object-store layer, credentials and endpoint from the environment
    (the probe is a subprocess: it gets them as the job does). It failed as "not found"
    before (the local path check), so a run on a remote dataset never started. A shard
    missing or of another size is named."""
    from datakit import S3_TEST_CREDS
    from storekit import moto_endpoint
    from unbroken.common.objstore import open_store
    from unbroken.data.prepare.pack import pack

    out = str(tmp_path / "ds")
    samples = ({"__key__": f"s{i:04d}", "bin": os.urandom(500)} for i in range(40))
    pack(samples, out, shard_size=12_000, workers=1, fsync=False, progress=False)
    names = sorted(os.listdir(out))
    for k, v in S3_TEST_CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with moto_endpoint() as ep:
        monkeypatch.setenv("AWS_ENDPOINT_URL", ep)
        import boto3

        boto3.client("s3", endpoint_url=ep).create_bucket(Bucket="data")
        store = open_store("s3://data/ds")
        for n in names:
            with open(os.path.join(out, n), "rb") as f:
                store.put_bytes(n, f.read())
        r = _check(PreflightConfig(data="s3://data/ds"), "data")
        assert r.ok and "shards present with the recorded sizes" in r.detail, r.detail
        assert _check(PreflightConfig(data="s3://data/ds/dataset.json"), "data").ok
        shard = next(n for n in names if n.endswith(".tar"))
        store.put_bytes(shard, b"short")
        r = _check(PreflightConfig(data="s3://data/ds"), "data")
        assert not r.ok and f"{shard}: 5 bytes, manifest says" in r.detail, r.detail
        store.delete([shard])
        r = _check(PreflightConfig(data="s3://data/ds"), "data")
        assert not r.ok and f"{shard}: no such object" in r.detail, r.detail
        r = _check(PreflightConfig(data="s3://data/nope"), "data")
        assert not r.ok and "FileNotFoundError" in r.detail and "nope" in r.detail, r.detail
        store.close()


def test_a_dataset_over_plain_http_is_checked_a_head_per_file(tmp_path):
    """Plain HTTP has no listing (the listing's PROPFIND was refused, 501, so a dataset
    served over http:// never passed): each listed file's size comes from a HEAD."""
    from storekit import RangeHTTPServer
    from unbroken.data.prepare.pack import pack

    out = tmp_path / "ds"
    samples = ({"__key__": f"s{i:04d}", "bin": os.urandom(500)} for i in range(40))
    pack(samples, str(out), shard_size=12_000, workers=1, fsync=False, progress=False)
    with RangeHTTPServer(str(tmp_path)) as srv:
        r = _check(PreflightConfig(data=f"{srv.url}/ds"), "data")
        assert r.ok and "shards present with the recorded sizes" in r.detail, r.detail
        shard = sorted(n for n in os.listdir(out) if n.endswith(".tar"))[1]
        os.truncate(out / shard, 7)
        r = _check(PreflightConfig(data=f"{srv.url}/ds"), "data")
        assert not r.ok and f"{shard}: 7 bytes, manifest says" in r.detail, r.detail
        os.unlink(out / shard)
        r = _check(PreflightConfig(data=f"{srv.url}/ds"), "data")
        assert not r.ok and f"{shard}: no such object" in r.detail, r.detail
