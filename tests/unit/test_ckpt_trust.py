"""Issue 12, checkpoint half: each defect found by trying restore() as a hostile or unlucky
user would, reproduced on a real two-checkpoint root (steps 2 and 4).

Every case asserts the whole outcome: which step was restored, that the live state is
bit-identical to that step, what was logged, what `ckpt verify` says, and that nothing a
crafted file asked for happened.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckptkit import (
    PROTO,
    STOP,
    Blob,
    build_root,
    can_mount,
    data_files,
    edit_manifest,
    identical,
    p_call,
    p_stack_global,
    replace_file,
    small_state,
    snapshot,
    step_dir,
    tmpfs,
    train,
)
from unbroken.ckpt import Checkpointer, TrainState
from unbroken.ckpt.export import export_safetensors, verify_report, verify_steps
from unbroken.cli import main


@pytest.fixture
def root(tmp_path) -> tuple[str, dict[int, dict[str, Any]]]:
    r = str(tmp_path / "ck")
    return r, build_root(r)


def _restore(
    root: str, caplog: pytest.LogCaptureFixture
) -> tuple[int | None, TrainState, list[str]]:
    st, _, _ = small_state(seed=9)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        got = Checkpointer(root, st).restore()
    warns = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return got, st, warns


def _verdicts(root: str) -> dict[int, str]:
    """`ckpt verify`'s verdict per step: "ok" or "DAMAGED" (the report agrees)."""
    got = {v.step: "ok" if v.ok else "DAMAGED" for v in verify_steps(root)}
    ok, _ = verify_report(root)
    assert ok == all(v == "ok" for v in got.values())
    return got


# --- 1. nothing from a checkpoint is executed ------------------------------------------------


def test_crafted_metadata_with_a_dotted_global_runs_no_code(root, tmp_path, caplog) -> None:
    """The issue's exploit: ``("torch.distributed.checkpoint.filesystem", "os.system")``
    through STACK_GLOBAL, checksums updated, tensors marked sharded so DCP reads .metadata."""
    r, want = root
    marker = tmp_path / "PWNED"
    d = step_dir(r, 4)
    for_dcp = {"sharded": True, "stats": None, "checksum": None}  # what sharded tensors look like
    edit_manifest(
        d, lambda m: [t.update(for_dcp) for k, t in m["tensors"].items() if "/model/" in k]
    )
    fn = p_stack_global("torch.distributed.checkpoint.filesystem", "os.system")
    replace_file(d, ".metadata", PROTO + p_call(fn, f"touch {marker}") + STOP)
    assert _verdicts(r) == {2: "ok", 4: "DAMAGED"}
    got, st, warns = _restore(r, caplog)
    assert got == 2 and identical(snapshot(st), want[2])
    assert not marker.exists()
    assert len(warns) == 1 and "step 4" in warns[0] and ".metadata" in warns[0]


# --- 2. restore() never raises for a damaged checkpoint -------------------------------------


def _first_weight(m: dict[str, Any]) -> dict[str, Any]:
    return m["tensors"]["components/model/0.weight"]


def _other_rank_file(m: dict[str, Any]) -> None:
    m["ranks"]["0"]["state"] = "state-rank1.json"


MANIFEST_EDITS: dict[str, Callable[[dict[str, Any]], object]] = {
    # what single bit flips that keep the JSON valid did to the old restore()
    "dtype-float33": lambda m: _first_weight(m).update(dtype="float33"),
    "chunk-length": lambda m: _first_weight(m)["chunks"][0].update(
        length=_first_weight(m)["chunks"][0]["length"] - 64
    ),
    "rank-file": _other_rank_file,
    # issue 23 item 2: format version 4 records no statistics; one that has some, or half
    # of them, is damage
    "stats-no-norm": lambda m: _first_weight(m).update(stats={"sum": 0.0}),
    "stats-no-sum": lambda m: _first_weight(m).update(stats={"norm": 0.0}),
    "stats-in-version-4": lambda m: _first_weight(m).update(stats={"sum": 0.0, "norm": 0.0}),
    "tensor-dropped": lambda m: m["tensors"].pop("components/model/0.weight"),
    "marked-sharded": lambda m: _first_weight(m).update(sharded=True),
    "shape-transposed": lambda m: _first_weight(m).update(shape=[16, 32]),
    "world-size-text": lambda m: m.update(world_size="1"),
    "file-size-huge": lambda m: m["files"][".metadata"].update(size=1 << 62),
    "created-text": lambda m: m.update(created="yesterday"),
    "created-earlier": lambda m: m.update(created=m["created"] - 3600),
    "rank-on-a-shared-key": lambda m: _first_weight(m).update(rank=0),
    "renamed-per-rank": lambda m: m["tensors"].__setitem__(
        "rank0/components/model/0.weight", m["tensors"].pop("components/model/0.weight")
    ),
}
# Re-signed, this one is a true (if different) description of the same bytes: the newest
# checkpoint loads, bit-identical.
HARMLESS_WHEN_CRAFTED = {"created-earlier"}


@pytest.mark.parametrize("resign", [False, True], ids=["flipped", "crafted"])
@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_a_damaged_manifest_falls_back_and_verify_agrees(root, caplog, edit, resign) -> None:
    """``flipped``: as bit rot leaves it (the manifest's own checksum catches it);
    ``crafted``: re-signed, so the field's own check must catch it."""
    r, want = root
    edit_manifest(step_dir(r, 4), MANIFEST_EDITS[edit], resign=resign)
    if resign and edit in HARMLESS_WHEN_CRAFTED:
        assert _verdicts(r) == {2: "ok", 4: "ok"}
        got, st, warns = _restore(r, caplog)
        assert got == 4 and identical(snapshot(st), want[4]) and not warns
        return
    assert _verdicts(r) == {2: "ok", 4: "DAMAGED"}
    got, st, warns = _restore(r, caplog)
    assert got == 2 and identical(snapshot(st), want[2])
    assert len(warns) == 1 and "step 4" in warns[0], warns
    assert os.path.isdir(step_dir(r, 2)) and not os.path.exists(step_dir(r, 4))


def test_our_own_checkpoints_take_the_zero_copy_path(root, monkeypatch) -> None:
    """The checks above must not push our own checkpoints off the mmap fast path."""
    from unbroken.ckpt import tensor_io as saver

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("torch.load used for a checkpoint unbroken wrote")

    monkeypatch.setattr(saver.torch, "load", refuse)
    r, want = root
    st, _, _ = small_state(seed=9)
    assert Checkpointer(r, st).restore() == 4 and identical(snapshot(st), want[4])


def test_every_dtype_round_trips_on_the_zero_copy_path(tmp_path, monkeypatch) -> None:
    from unbroken.ckpt import tensor_io as saver
    from unbroken.ckpt.manifest import DTYPES

    dtypes = [getattr(torch, n) for n in DTYPES if isinstance(getattr(torch, n, None), torch.dtype)]
    torch.manual_seed(0)
    src = {str(d): (torch.randn(5, 3) * 4).to(d) for d in dtypes}
    src["empty"] = torch.empty(0, 7)
    src["scalar"] = torch.tensor(3.5)
    ck = Checkpointer(str(tmp_path), TrainState(extras={"t": Blob(src)}))
    ck.save(1)
    monkeypatch.setattr(saver.torch, "load", lambda *a, **k: pytest.fail("slow path taken"))
    blob = Blob({k: torch.zeros_like(v) for k, v in src.items()})
    assert Checkpointer(str(tmp_path), TrainState(extras={"t": blob})).restore() == 1
    assert identical(blob.t, src)


def test_verify_checks_every_ranks_state_file(root) -> None:
    """A 2-rank restore reads state-rank1.json on rank 1; `ckpt verify` (one process) must
    check it too, or it would pass a checkpoint that restore refuses."""
    r, _ = root
    d = step_dir(r, 4)
    with open(os.path.join(d, "state-rank0.json"), "rb") as src:
        state = src.read()
    replace_file(d, "state-rank1.json", state)  # as a 2-rank save leaves it

    def two_ranks(m: dict[str, Any]) -> None:
        m["world_size"] = 2
        m["ranks"]["1"] = {"state": "state-rank1.json"}

    edit_manifest(d, two_ranks)
    assert _verdicts(r) == {2: "ok", 4: "ok"}
    with open(os.path.join(d, "state-rank1.json"), "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 2]))
    (v4,) = [v for v in verify_steps(r) if v.step == 4]
    assert not v4.ok and v4.reason == "checksum" and "state-rank1.json" in v4.detail


# --- 3. manifest paths are confined to the step directory -----------------------------------


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_paths_leaving_the_step_directory_are_refused(root, tmp_path, caplog, where) -> None:
    """The data file moved outside the checkpoint, the manifest pointing at it (checksums and
    all correct): following the path would load the newest step. It must be refused."""
    r, want = root
    d = step_dir(r, 4)
    name = data_files(d)[0]
    outside = tmp_path / "elsewhere" / "x.distcp"
    outside.parent.mkdir()
    os.rename(os.path.join(d, name), outside)
    path = "../../elsewhere/x.distcp" if where == "relative" else str(outside)
    assert os.path.samefile(os.path.join(d, path), outside)

    def repoint(m: dict[str, Any]) -> None:
        m["files"][path] = m["files"].pop(name)
        for t in m["tensors"].values():
            for c in t["chunks"]:
                if c["file"] == name:
                    c["file"] = path

    edit_manifest(d, repoint)
    out = str(tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match="failed verification"):
        export_safetensors(r, out, step=4)
    assert main(["ckpt", "export", r, "--to", out, "--step", "4"]) == 1  # damaged: check failed
    assert not os.path.exists(out)
    assert _verdicts(r) == {2: "ok", 4: "DAMAGED"}
    got, st, warns = _restore(r, caplog)
    assert got == 2 and identical(snapshot(st), want[2])
    assert len(warns) == 1 and path in warns[0]


def test_a_data_file_symlinked_out_of_the_step_directory_is_refused(root, tmp_path, caplog) -> None:
    r, want = root
    d = step_dir(r, 4)
    name = data_files(d)[0]
    outside = tmp_path / "elsewhere.distcp"
    os.rename(os.path.join(d, name), outside)
    os.symlink(outside, os.path.join(d, name))  # same bytes, checksum matches
    assert _verdicts(r) == {2: "ok", 4: "DAMAGED"}
    got, st, warns = _restore(r, caplog)
    assert got == 2 and identical(snapshot(st), want[2])
    assert len(warns) == 1 and "symlink" in warns[0]


# --- 5. read-only file system ---------------------------------------------------------------


def test_read_only_root_with_a_damaged_newest_skips_it(tmp_path, caplog) -> None:
    if not can_mount():
        pytest.skip("needs root and mount(8) to make a real read-only file system")
    with tmpfs(str(tmp_path / "ro")) as r:
        want = build_root(r)
        d = step_dir(r, 4)
        path = os.path.join(d, data_files(d)[0])
        with open(path, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
        os.mkdir(os.path.join(r, ".tmp-step-00000006.deadbeef"))
        subprocess.run(["mount", "-o", "remount,ro", r], check=True)
        with pytest.raises(OSError) as e:
            open(os.path.join(r, "probe"), "w")
        assert e.value.errno == errno.EROFS
        got, st, warns = _restore(r, caplog)
        assert got == 2 and identical(snapshot(st), want[2])
        damaged = [w for w in warns if "step 4" in w]
        assert len(damaged) == 1 and "skipped" in damaged[0] and "read-only" in damaged[0].lower()
        assert not any("removed" in w for w in warns), warns
        assert os.path.isdir(d) and os.path.isdir(os.path.join(r, ".tmp-step-00000006.deadbeef"))


# --- 6. manifest.json deleted -----------------------------------------------------------------


def test_a_deleted_manifest_is_reported_and_the_run_saves_that_step_again(
    root, caplog, capsys
) -> None:
    r, want = root
    os.unlink(os.path.join(step_dir(r, 4), "manifest.json"))
    assert _verdicts(r) == {2: "ok", 4: "DAMAGED"}
    assert main(["ckpt", "verify", r]) == 1
    assert "no-manifest" in capsys.readouterr().out
    st, m, opt = small_state(seed=9)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        ck = Checkpointer(r, st, every_steps=2, keep_last=None)
        assert ck.restore() == 2
    warns = [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]
    assert len(warns) == 1 and "step 4" in warns[0] and "manifest.json" in warns[0], warns
    assert identical(snapshot(st), want[2])
    for _ in range(2):  # the resumed run reaches step 4 again and saves it
        train(st, m, opt, 1)
        ck.maybe_save()
    ck.close()
    assert ck.store.steps() == [2, 4]
    st2, _, _ = small_state(seed=3)
    assert Checkpointer(r, st2).restore() == 4 and identical(snapshot(st2), snapshot(st))


# --- 7. all-or-nothing apply ------------------------------------------------------------------


def test_restore_into_a_model_of_another_shape_leaves_it_untouched(root) -> None:
    r, _ = root
    torch.manual_seed(1)
    # the first layer matches the checkpoint, the last does not
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    st = TrainState(model=m, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 3))
    before = snapshot(st)
    with pytest.raises(ValueError) as e:
        Checkpointer(r, st).restore()
    msg = str(e.value)
    assert "components/model/2.weight" in msg and "[4, 32]" in msg and "[8, 32]" in msg
    assert identical(snapshot(st), before) and st.step == 0
    assert os.path.isdir(step_dir(r, 4))  # a valid checkpoint is never quarantined for this


def test_restore_into_a_model_with_an_extra_layer_names_the_key(root) -> None:
    r, _ = root
    m = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4), torch.nn.Linear(4, 4)
    )
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    st = TrainState(model=m, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 3))
    before = snapshot(st)
    with pytest.raises(ValueError, match="components/model/3.weight"):
        Checkpointer(r, st).restore()
    assert identical(snapshot(st), before)
