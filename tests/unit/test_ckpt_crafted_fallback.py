"""Damage to every step of a root.

One clear error that lists each step and why, never a traceback of another type; and the
restart after it (a supervisor retries the worker) must still say why, though the first
attempt moved every step aside: it said only "no step-N directory".
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from ckptkit import build_root, flip, identical, restore_here, small_state, snapshot, step_dir
from unbroken.ckpt import Checkpointer


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Any]]:
    r = str(tmp_path_factory.mktemp("fallback") / "ck")
    return r, build_root(r)


def test_every_step_damaged_is_one_error_that_lists_them_on_every_attempt(
    pristine, tmp_path
) -> None:
    src, _ = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    os.unlink(os.path.join(step_dir(root, 2), "manifest.json"))
    flip(os.path.join(step_dir(root, 4), "__0_0.distcp"), 100)

    errors = []
    for _ in range(2):  # the first attempt, and the restart after it
        st, _, _ = small_state(seed=9)
        before = snapshot(st)
        ck = Checkpointer(root, st)
        try:
            with pytest.raises(RuntimeError, match="holds no valid checkpoint") as e:
                ck.restore()
        finally:
            ck.close()
        assert identical(snapshot(st), before)  # nothing of a damaged step was applied
        errors.append(str(e.value))
    for text in errors:
        assert "step 2" in text and "no-manifest" in text, text
        assert "step 4" in text and "checksum" in text, text
    assert sorted(os.listdir(root)) == [
        "corrupt-step-00000002-no-manifest",
        "corrupt-step-00000004-checksum",
    ]


def test_a_sparse_file_does_not_raise_the_memory_bound(pristine, tmp_path) -> None:
    """The parse budget is 2 x the bytes on disk + 256 MiB; it was computed from the
    apparent sizes of the step's files, so one sparse file of 1 TiB (no disk used) lifted
    it to 2 TiB and a 20 MB manifest of empty lists (refused otherwise) was parsed at 500 MB.
    """
    src, _ = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    d = step_dir(root, 4)
    path = os.path.join(d, "manifest.json")
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:  # not re-signed: it is parsed before its checksum is checked
        f.write(
            raw.replace(b'"data_state": null', b'"data_state": [' + b"[]," * 6_500_000 + b"[]]")
        )
    with open(os.path.join(d, "padding"), "wb") as f:
        f.truncate(1 << 40)
    on_disk = sum(
        os.lstat(os.path.join(dp, n)).st_blocks * 512 for dp, _, ns in os.walk(root) for n in ns
    )
    bound = 2 * on_disk + 256 * 2**20

    got, _, peak = restore_here(root)
    assert got == 2
    assert peak < bound, f"restore peaked at {peak >> 20} MiB, bound {bound >> 20} MiB"
    assert os.path.isdir(os.path.join(root, "corrupt-step-00000004-too-large"))
