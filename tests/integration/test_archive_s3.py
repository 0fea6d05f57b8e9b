"""Remote archive over a real S3 API: moto's ThreadedMotoServer on 127.0.0.1 + s3fs.

Archive, lose the local disk, restore bit-identically from S3; a damaged remote object is
detected and the older remote step is used; upload failures are retried and reported, never
raised; local retention may delete a step while it uploads; remote retention.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from datakit import S3_TEST_CREDS
from storekit import moto_endpoint
from unbroken.ckpt import ArchiveConfig, Checkpointer, TrainState
from unbroken.ckpt.archive.remote import Archive, ArchiveError, fetch_newest_valid
from unbroken.ckpt.archive.uploader import BackgroundUploader

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

_CREDS = S3_TEST_CREDS


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _CREDS.items():
            mp.setenv(k, v)
        mp.setattr(logging.getLogger("werkzeug"), "level", logging.ERROR)  # one line per request
        with moto_endpoint() as ep:  # port 0: the server's own, read once it listens
            yield ep


def _options(endpoint: str) -> dict[str, Any]:
    # One botocore attempt and short timeouts: retrying is the Archive's job, and a test of
    # failures must not sit in botocore's own backoff.
    return {
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
        "skip_instance_cache": True,
    }


@pytest.fixture
def s3(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**_options(endpoint))


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    s3.mkdir(name)
    return name


def _archive(endpoint: str, bucket: str, **kw: Any) -> Archive:
    kw.setdefault("backoff_s", 0.01)
    return Archive(f"s3://{bucket}/run1", storage_options=_options(endpoint), **kw)


def _state(seed: int) -> tuple[TrainState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return TrainState(model=m, optimizer=opt), m, opt


def _train(st: TrainState, m: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        m(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        st.step += 1


def _snapshot(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            out[f"opt/{i}/{k}"] = torch.as_tensor(v).clone()
    return out


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).view(torch.uint8).numpy())


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and _raw(a[k]) == _raw(b[k])
        for k in a
    )


def _two_steps(root: str) -> dict[int, dict[str, torch.Tensor]]:
    """Save steps 2 and 4 under ``root``; returns the exact tensors of each."""
    st, m, opt = _state(0)
    ck = Checkpointer(root, st, keep_last=None)
    snaps = {}
    for _ in range(2):
        _train(st, m, opt, 2)
        ck.save()
        snaps[st.step] = _snapshot(m, opt)
    return snaps


def _restore(root: str) -> tuple[int | None, dict[str, torch.Tensor]]:
    st, m, opt = _state(1)  # other initial values: restore must overwrite every tensor
    _train(st, m, opt, 1)  # materialize optimizer state
    step = Checkpointer(root, st).restore()
    return step, _snapshot(m, opt)


def test_archive_lose_local_disk_restore_bit_identical(
    endpoint: str, bucket: str, tmp_path
) -> None:
    root = str(tmp_path / "ckpt")
    snaps = _two_steps(root)
    arch = _archive(endpoint, bucket)
    step: int | None
    for step in (2, 4):
        arch.upload(os.path.join(root, f"step-{step:08d}"), step)
    arch.upload(os.path.join(root, "step-00000004"), 4)  # already there: a no-op
    assert arch.steps() == [2, 4]
    assert arch.info(4).size == sum(
        os.path.getsize(os.path.join(root, "step-00000004", n))
        for n in os.listdir(os.path.join(root, "step-00000004"))
        if n != "manifest.json"
    )

    shutil.rmtree(root)  # the node is replaced: nothing local survives
    assert fetch_newest_valid(arch, root) == 4
    assert sorted(os.listdir(root)) == ["step-00000004"]  # no temp debris
    step, got = _restore(root)
    assert step == 4
    assert _bits_equal(got, snaps[4])


def test_corrupted_remote_object_is_detected_and_older_step_used(
    endpoint: str, bucket: str, s3: Any, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    root = str(tmp_path / "ckpt")
    snaps = _two_steps(root)
    arch = _archive(endpoint, bucket)
    step: int | None
    for step in (2, 4):
        arch.upload(os.path.join(root, f"step-{step:08d}"), step)
    victim = sorted(n for n in s3.ls(f"{bucket}/run1/step-00000004") if n.endswith(".distcp"))[0]
    data = bytearray(s3.cat_file(victim))
    data[len(data) // 2] ^= 0x10  # one flipped bit, same size: only the checksum can tell
    s3.pipe_file(victim, bytes(data))

    with pytest.raises(ArchiveError) as ei:
        arch.download(4, str(tmp_path / "probe"))
    assert ei.value.damaged and "checksum mismatch" in ei.value.reason
    assert os.path.basename(victim) in str(ei.value)

    shutil.rmtree(root)
    with caplog.at_level(logging.WARNING, logger="unbroken.ckpt.archive.remote"):
        assert fetch_newest_valid(arch, root) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1 and "step 4" in warnings[0] and os.path.basename(victim) in warnings[0]
    )
    assert sorted(os.listdir(root)) == ["step-00000002"]
    step, got = _restore(root)
    assert step == 2 and _bits_equal(got, snaps[2])


def test_truncated_remote_object_is_detected(endpoint: str, bucket: str, s3: Any, tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    _two_steps(root)
    arch = _archive(endpoint, bucket)
    arch.upload(os.path.join(root, "step-00000004"), 4)
    victim = f"{bucket}/run1/step-00000004/state-rank0.json"
    s3.pipe_file(victim, s3.cat_file(victim)[:-7])
    with pytest.raises(ArchiveError) as ei:
        arch.download(4, str(tmp_path / "probe"))
    assert ei.value.damaged and "state-rank0.json" in ei.value.file and "bytes" in ei.value.reason
    assert fetch_newest_valid(arch, str(tmp_path / "fresh")) is None  # nothing else remote


def test_damaged_local_checkpoint_is_never_committed_remotely(
    endpoint: str, bucket: str, tmp_path
) -> None:
    root = str(tmp_path / "ckpt")
    _two_steps(root)
    d = os.path.join(root, "step-00000004")
    name = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]
    with open(os.path.join(d, name), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    arch = _archive(endpoint, bucket)
    with pytest.raises(ArchiveError) as ei:
        arch.upload(d, 4)
    assert ei.value.damaged and name in str(ei.value) and "not archived" in str(ei.value)
    assert arch.steps() == []  # the manifest (commit marker) was never written


def test_upload_failure_is_retried_and_reported_never_raised(
    endpoint: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    root = str(tmp_path / "ckpt")
    _two_steps(root)
    missing = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    up = BackgroundUploader(_archive(endpoint, missing, retries=2))
    with caplog.at_level(logging.INFO, logger="unbroken.ckpt.archive.remote"):
        up.submit(os.path.join(root, "step-00000004"), 4)  # returns at once, raises nothing
        assert up.flush(timeout=30)
        up.close()
    assert up.uploaded == []
    assert len(up.errors) == 1
    err = up.errors[0]
    assert isinstance(err, ArchiveError) and not err.damaged
    assert missing in str(err) and "after 3 attempt(s)" in err.reason
    msgs = [r.getMessage() for r in caplog.records]
    assert any("retry 2/2" in m for m in msgs)
    assert any(
        r.levelno == logging.WARNING and "upload of step 4 failed" in r.getMessage()
        for r in caplog.records
    )


def test_transient_failure_recovers_and_local_retention_does_not_wait(
    endpoint: str, s3: Any, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    root = str(tmp_path / "ckpt")
    snaps = _two_steps(root)
    late = f"late-{uuid.uuid4().hex[:8]}"  # the bucket appears only after the first attempts
    up = BackgroundUploader(_archive(endpoint, late, retries=6, backoff_s=0.1))
    step_dir = os.path.join(root, "step-00000004")

    class _CreateOnFirstRetry(logging.Handler):  # the bucket appears once an attempt failed
        def emit(self, record: logging.LogRecord) -> None:
            if "retry 1/6" in record.getMessage():  # files upload in parallel: maybe twice
                with contextlib.suppress(FileExistsError):
                    s3.mkdir(late)

    creator = _CreateOnFirstRetry()
    archive_log = logging.getLogger("unbroken.ckpt.archive.remote")
    archive_log.addHandler(creator)
    with caplog.at_level(logging.INFO, logger="unbroken.ckpt.archive.remote"):
        up.submit(step_dir, 4)
        shutil.rmtree(step_dir)  # local retention deletes the step while it still uploads
        try:
            assert up.flush(timeout=30)
        finally:
            archive_log.removeHandler(creator)
            up.close()
    assert up.errors == [] and up.uploaded == [4]
    assert any("retry 1/6" in r.getMessage() for r in caplog.records)  # it did fail first
    fresh = str(tmp_path / "fresh")
    assert fetch_newest_valid(_archive(endpoint, late), fresh) == 4
    step, got = _restore(fresh)
    assert step == 4 and _bits_equal(got, snaps[4])


def test_remote_prune_keeps_the_right_steps_and_ignores_foreign_objects(
    endpoint: str, bucket: str, s3: Any, tmp_path
) -> None:
    root = str(tmp_path / "ckpt")
    st, m, opt = _state(0)
    ck = Checkpointer(root, st, keep_last=None)
    up = BackgroundUploader(_archive(endpoint, bucket), max_pending=10, keep_last=2, keep_every=3)
    for step in range(1, 7):
        ck.save(step)
        up.submit(ck.store.step_dir(step), step)
    s3.pipe_file(f"{bucket}/run1/notes.txt", b"foreign")
    s3.pipe_file(f"{bucket}/run1/step-00000009/__0_0.distcp", b"half an upload, no manifest")
    assert up.close(timeout=60)
    assert up.errors == [] and up.uploaded == [1, 2, 3, 4, 5, 6]
    arch = _archive(endpoint, bucket)
    assert arch.steps() == [3, 5, 6]
    left = {p.rsplit("/", 1)[-1] for p in s3.ls(f"{bucket}/run1", refresh=True)}
    assert left == {"notes.txt", "step-00000003", "step-00000005", "step-00000006", "step-00000009"}
    assert arch.prune(keep_last=1) == [3, 5]
    assert arch.steps() == [6]
    assert s3.cat_file(f"{bucket}/run1/notes.txt") == b"foreign"


def test_checkpointer_archive_option_restores_from_s3_after_the_disk_is_lost(
    endpoint: str, bucket: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user-facing path: ``Checkpointer(archive=ArchiveConfig("s3://...", every=2))``
    (endpoint from ``AWS_ENDPOINT_URL``, which botocore reads)."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    url = f"s3://{bucket}/job"
    root = str(tmp_path / "ckpt")
    try:
        st, m, opt = _state(0)
        ck = Checkpointer(root, st, keep_last=1, archive=ArchiveConfig(url, every=2))
        snaps = {}
        for _ in range(5):
            _train(st, m, opt, 1)
            ck.save()
            snaps[st.step] = _snapshot(m, opt)
        ck.close()  # waits for the background uploads
        assert Archive(url).steps() == [2, 4]
        assert os.listdir(root) == ["step-00000005"]  # local retention did not wait

        shutil.rmtree(root)
        st2, m2, opt2 = _state(1)
        _train(st2, m2, opt2, 1)
        ck2 = Checkpointer(root, st2, archive=ArchiveConfig(url))
        assert ck2.restore() == 4
        ck2.close()
        assert _bits_equal(_snapshot(m2, opt2), snaps[4])
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # its client points at this test's server


def test_fetch_never_overwrites_a_local_step_and_honours_older_than(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    _two_steps(root)
    arch = Archive(f"memory://fetch-{uuid.uuid4().hex[:8]}", backoff_s=0.01)
    for step in (2, 4):
        arch.upload(os.path.join(root, f"step-{step:08d}"), step)
    fresh = tmp_path / "fresh"
    (fresh / "step-00000004").mkdir(parents=True)  # not ours (no manifest): left alone
    assert fetch_newest_valid(arch, str(fresh)) == 2
    assert os.listdir(fresh / "step-00000004") == []
    assert fetch_newest_valid(arch, str(tmp_path / "other"), older_than=4) == 2
    assert fetch_newest_valid(arch, str(tmp_path / "none"), older_than=2) is None


def test_archive_round_trip_through_the_object_store_layer(
    endpoint: str, bucket: str, tmp_path
) -> None:
    """issue 22 item 2: the archive's file transfers go through the object-store layer on
    obstore: a file above the part size is a multipart upload (a throttled part is retried),
    every download GET is ranged, and the step comes back byte for byte. Issue 22 round 2
    item 1: a file below two ``split_bytes`` (64 MiB) comes down in ONE streamed GET, not one
    per 8 MiB part (each ranged GET cost moto a whole-object read: 0.34x s3torchconnector)."""
    from storekit import Fault, FaultProxy

    root = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    m = torch.nn.Linear(2048, 1600)  # 13 MB of weights: above the 8 MiB part size
    st = TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    st.step = 1
    Checkpointer(root, st, keep_last=None).save()
    step_dir = os.path.join(root, "step-00000001")
    with FaultProxy(endpoint) as proxy:
        arch = _archive(proxy.endpoint, bucket)
        assert arch._store.kind == "obstore"
        proxy.faults.append(Fault("503", 1, method="PUT", path="partNumber=2"))
        arch.upload(step_dir, 1)
        sent = proxy.requests
        assert any(r[0] == "POST" and "uploads" in r[1] for r in sent), sent
        assert sum(r[0] == "PUT" and "partNumber=2" in r[1] for r in sent) == 2, sent
        fresh = str(tmp_path / "fresh")
        n0 = len(proxy.requests)
        assert fetch_newest_valid(arch, fresh) == 1
        gets = [r for r in proxy.requests[n0:] if r[0] == "GET" and "list-type" not in r[1]]
    got = os.path.join(fresh, "step-00000001")
    assert sorted(os.listdir(got)) == sorted(os.listdir(step_dir))
    for name in os.listdir(step_dir):
        with (
            open(os.path.join(step_dir, name), "rb") as a,
            open(os.path.join(got, name), "rb") as b,
        ):
            assert a.read() == b.read(), name
    data_gets = [r for r in gets if not r[1].split("?")[0].endswith("/manifest.json")]
    assert data_gets and all(r[2].startswith("bytes=") for r in data_gets), data_gets
    per_file = collections.Counter(r[1].split("?")[0] for r in data_gets)
    assert max(per_file.values()) == 1, per_file
    assert max(os.path.getsize(os.path.join(step_dir, n)) for n in os.listdir(step_dir)) > 8 << 20


_OBSTORE_ONLY = r"""
import os, sys
sys.modules["s3fs"] = sys.modules["aiobotocore"] = sys.modules["botocore"] = None  # no fsspec S3
root, url, fresh = sys.argv[1:4]
from unbroken.ckpt.archive.remote import Archive, fetch_newest_valid
arch = Archive(url, backoff_s=0.01)
assert arch._store.kind == "obstore", arch._store.kind
for step in (2, 4):
    arch.upload(os.path.join(root, f"step-{step:08d}"), step)
print("steps", arch.steps())
print("pruned", arch.prune(keep_last=1))
print("fetched", fetch_newest_valid(arch, fresh))
"""


def test_an_s3_archive_needs_no_fsspec_backend(endpoint: str, bucket: str, tmp_path) -> None:
    """issue 22 item 2, finished: every archive request (listing, manifest GET and PUT,
    existence check, retention's deletes, the transfers) goes through the object-store layer,
    so an ``s3://`` (or ``gs://``, ``az://``) archive works with obstore alone: here s3fs and
    botocore cannot even be imported, and upload, listing, pruning and a verified download
    still do their work against moto."""
    root = str(tmp_path / "ckpt")
    snaps = _two_steps(root)
    env = {**os.environ, **S3_TEST_CREDS, "AWS_ENDPOINT_URL": endpoint}
    fresh = str(tmp_path / "fresh")
    proc = subprocess.run(
        [sys.executable, "-c", _OBSTORE_ONLY, root, f"s3://{bucket}/solo", fresh],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["steps [2, 4]", "pruned [2]", "fetched 4"], proc.stdout
    step, got = _restore(fresh)
    assert step == 4 and all(torch.equal(got[k], v) for k, v in snaps[4].items())


def test_a_local_archive_prune_leaves_no_directory_of_a_removed_step(tmp_path) -> None:
    """Retention on a ``file://`` archive removes a step's directory, not only its files (a
    listing of the store would stay clean either way; the disk would not)."""
    root = str(tmp_path / "ckpt")
    _two_steps(root)
    arch = Archive(f"file://{tmp_path}/arch")
    for step in (2, 4):
        arch.upload(os.path.join(root, f"step-{step:08d}"), step)
    assert arch.prune(keep_last=1) == [2] and arch.steps() == [4]
    assert sorted(os.listdir(tmp_path / "arch")) == ["step-00000004"]


def test_listing_the_steps_reads_one_level_and_heads_each_manifest(
    endpoint: str, bucket: str, s3: Any, tmp_path
) -> None:
    """``steps()`` must not list every object of the archive: a step of a job on thousands of
    ranks holds thousands of files, and a run that keeps its steps would page through all of
    them (1,000 keys a page) before every restore and every retention pass. It lists the root
    one level deep (with a delimiter) and asks each ``step-N/`` for its manifest by HEAD; a
    step without one (an upload cut short), a deeper manifest, a foreign object or directory
    are not steps."""
    from storekit import FaultProxy

    root = str(tmp_path / "ckpt")
    _two_steps(root)
    s3.pipe_file(f"{bucket}/run1/notes.txt", b"foreign")
    s3.pipe_file(f"{bucket}/run1/step-00000009/__0_0.distcp", b"half an upload, no manifest")
    s3.pipe_file(f"{bucket}/run1/step-00000011/deeper/manifest.json", b"{}")
    s3.pipe_file(f"{bucket}/run1/logs/manifest.json", b"{}")
    with FaultProxy(endpoint) as proxy:
        arch = _archive(proxy.endpoint, bucket)
        for step in (2, 4):
            arch.upload(os.path.join(root, f"step-{step:08d}"), step)
        n0 = len(proxy.requests)
        assert arch.steps() == [2, 4]
        sent = proxy.requests[n0:]
    lists = [r for r in sent if r[0] == "GET" and "list-type" in r[1]]
    assert len(lists) == 1 and "delimiter=%2F" in lists[0][1], sent
    heads = sorted(r[1].split("?")[0].rsplit("/", 2)[-2] for r in sent if r[0] == "HEAD")
    assert heads == ["step-00000002", "step-00000004", "step-00000009", "step-00000011"], sent
    assert len(sent) == 5, sent
