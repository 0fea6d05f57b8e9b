"""`unbroken ckpt ls|inspect|verify|export` through unbroken.cli.main on real checkpoints."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from unbroken.ckpt import Checkpointer, TrainState
from unbroken.ckpt.archive.remote import Archive
from unbroken.ckpt.store import Store
from unbroken.ckpt.verify import load_verified
from unbroken.cli import main


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def run(tmp_path) -> dict[str, Any]:
    """Steps 3 and 6 of a small run with model, optimizer and EMA; the exact weights of each."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ema = torch.optim.swa_utils.AveragedModel(
        m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    st = TrainState(model=m, optimizer=opt, ema=ema)
    root = str(tmp_path / "ckpt")
    ck = Checkpointer(root, st, keep_last=None)
    weights, ema_weights = {}, {}
    for _ in range(2):
        for _ in range(3):
            m(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(m)
            st.step += 1
        ck.save()
        weights[st.step] = {k: v.clone() for k, v in m.state_dict().items()}
        ema_weights[st.step] = {k: v.clone() for k, v in ema.module.state_dict().items()}
    return {"root": root, "weights": weights, "ema": ema_weights}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def test_ls_local_and_remote(run: dict[str, Any], capsys, tmp_path) -> None:
    root = run["root"]
    os.mkdir(os.path.join(root, "corrupt-step-00000001-checksum"))
    rc, out, _ = _run(["ckpt", "ls", root], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[1].split() == ["STEP", "SIZE", "AGE", "STATUS"]
    assert lines[2].split()[0] == "3" and lines[2].split()[-1] == "local"
    assert lines[3].split()[0] == "6" and lines[3].split()[-1] == "local"
    assert "2 local" in out and "quarantined step 1 (checksum)" in out

    url = f"memory://ckpt-cli-{uuid.uuid4().hex[:8]}"
    Archive(url).upload(os.path.join(root, "step-00000006"), 6)
    rc, out, _ = _run(["ckpt", "ls", root, "--archive", url], capsys)
    assert rc == 0
    rows = {ln.split()[0]: ln.split()[-1] for ln in out.splitlines()[2:4]}
    assert rows == {"3": "local", "6": "local+remote"}
    assert "2 local, 1 remote" in out
    rc, out, _ = _run(["ckpt", "ls", url], capsys)  # the archive alone
    assert rc == 0 and out.splitlines()[2].split()[0] == "6" and "remote" in out.splitlines()[2]


def test_inspect_prints_the_manifest(run: dict[str, Any], capsys) -> None:
    rc, out, _ = _run(["ckpt", "inspect", run["root"]], capsys)
    assert rc == 0
    assert "step-00000006" in out.splitlines()[0]
    assert "step=6" in out and "world size      1" in out
    assert f"torch {torch.__version__}" in out
    assert "state-rank0.json" in out and ".metadata" in out
    # the largest tensor: the first Linear's weight, 32x16 float32 (or its EMA / Adam moments)
    biggest = out.split("largest tensors")[1].splitlines()[2]
    assert "32x16" in biggest and "float32" in biggest and "2.0 kB" in biggest
    rc, out, _ = _run(["ckpt", "inspect", run["root"], "--step", "3"], capsys)
    assert rc == 0 and "step=3" in out
    rc, _, err = _run(["ckpt", "inspect", run["root"], "--step", "4"], capsys)
    assert rc == 2 and "committed steps: [3, 6]" in err


def test_verify_passes_then_exits_1_on_a_flipped_bit(run: dict[str, Any], capsys) -> None:
    root = run["root"]
    rc, out, _ = _run(["ckpt", "verify", root], capsys)
    assert rc == 0 and "all intact" in out
    d = os.path.join(root, "step-00000006")
    name = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]
    path = os.path.join(d, name)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x04]))
    before = sorted(os.listdir(root))
    rc, out, _ = _run(["ckpt", "verify", root], capsys)
    assert rc == 1
    rows = {ln.split()[0]: ln for ln in out.splitlines()[2:4]}
    assert " ok " in rows["3"] and "DAMAGED (checksum)" in rows["6"] and name in rows["6"]
    assert "1 of 2 checkpoint(s) DAMAGED" in out
    assert sorted(os.listdir(root)) == before  # verify is read-only: nothing quarantined
    rc, _, _ = _run(["ckpt", "verify", root, "--step", "3"], capsys)
    assert rc == 0


def test_export_model_and_ema_to_safetensors(run: dict[str, Any], capsys, tmp_path) -> None:
    root = run["root"]
    out_path = str(tmp_path / "out" / "model.safetensors")
    rc, out, _ = _run(["ckpt", "export", root, "--to", out_path], capsys)
    assert rc == 0 and "from step 6" in out
    got = load_file(out_path)
    assert sorted(got) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert _equal(got, run["weights"][6])
    # loads straight into a fresh model
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fresh.load_state_dict(got)

    rc, _, _ = _run(["ckpt", "export", root, "--to", out_path, "--step", "3"], capsys)
    assert rc == 0 and _equal(load_file(out_path), run["weights"][3])

    ema_path = str(tmp_path / "ema.safetensors")
    rc, _, _ = _run(["ckpt", "export", root, "--to", ema_path, "--component", "ema"], capsys)
    assert rc == 0
    got = load_file(ema_path)
    assert _equal(got, run["ema"][6]) and not _equal(got, run["weights"][6])

    rc, _, err = _run(["ckpt", "export", root, "--to", ema_path, "--component", "opt"], capsys)
    assert rc == 2 and "'ema'" in err and "'model'" in err and "--component" in err
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_chunk_assembly_matches_the_verified_reader(run: dict[str, Any]) -> None:
    """The path export takes for sharded checkpoints (tensors rebuilt from their DCP chunks)
    gives the same tensors as the verified fast reader."""
    from unbroken.ckpt.tensor_io import fill

    store = Store(run["root"])
    v = load_verified(store, 6)
    assert v.tensors
    whole = {k: torch.empty(t.shape, dtype=t.torch_dtype) for k, t in v.manifest.tensors.items()}
    fill(store.step_dir(6), v.manifest, whole)  # from the files, not from the views
    for k, t in whole.items():
        assert t.dtype == v.tensors[k].dtype and torch.equal(t, v.tensors[k]), k


def test_bad_input_is_a_clear_error(tmp_path, capsys) -> None:
    rc, _, err = _run(["ckpt", "verify", str(tmp_path / "nope")], capsys)
    assert rc == 2 and "does not exist" in err
    # a file where the root should be: said as it is, not "does not exist"
    (tmp_path / "corpus.txt").write_text("text")
    for verb in ("verify", "inspect", "ls"):
        rc, out, err = _run(["ckpt", verb, str(tmp_path / "corpus.txt")], capsys)
        assert rc == 2 and "corpus.txt" in err and "is a file, not a checkpoint directory" in err
    os.mkdir(tmp_path / "empty")
    # a checkpoint root without a checkpoint: the check failed (1), the message on stderr
    rc, out, err = _run(["ckpt", "inspect", str(tmp_path / "empty")], capsys)
    assert rc == 1 and "no committed checkpoint" in err and not out
    rc, out, err = _run(["ckpt", "verify", str(tmp_path / "empty")], capsys)
    assert rc == 1 and "no committed checkpoint" in err and not out
    # an archive that is not there is a bad argument, not an empty listing
    rc, out, err = _run(["ckpt", "ls", str(tmp_path / "empty"), "--archive", "no-such"], capsys)
    assert rc == 2 and "no-such" in err and "does not exist" in err and not out


@pytest.mark.timeout(120)
def test_an_archive_in_a_bucket_that_does_not_exist_is_named_not_listed_empty(
    tmp_path, capsys, monkeypatch
) -> None:
    """`ckpt ls --archive s3://typo/run` said "0 remote" and exit 0: a typo'd bucket looked
    like an archive nothing was uploaded to yet. An existing bucket without the prefix is
    such an archive."""
    import boto3
    from s3fs import S3FileSystem

    from datakit import S3_TEST_CREDS
    from storekit import moto_endpoint

    os.mkdir(tmp_path / "root")
    with moto_endpoint() as ep:
        for k, v in {**S3_TEST_CREDS, "AWS_ENDPOINT_URL": ep}.items():
            monkeypatch.setenv(k, v)
        boto3.client("s3", endpoint_url=ep).create_bucket(Bucket="real")
        argv = ["ckpt", "ls", str(tmp_path / "root"), "--archive"]
        try:
            rc, out, err = _run([*argv, "s3://real/run"], capsys)
            assert rc == 0 and "0 remote" in out, (out, err)
            rc, out, err = _run([*argv, "s3://typo/run"], capsys)
            assert rc == 2 and "s3://typo/run" in err and "bucket" in err and not out, (out, err)
        finally:  # fsspec keeps the filesystem, and with it this server's endpoint, otherwise
            S3FileSystem.clear_instance_cache()
