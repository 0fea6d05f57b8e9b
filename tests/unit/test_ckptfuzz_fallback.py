"""Damage to every step of a root (helper ckptfuzz).

One clear error that lists each step and why, never a traceback of another type; and the
restart after it (a supervisor retries the worker) must still say why, though the first
attempt moved every step aside: it said only "no step-N directory".
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from ckptkit import build_root, flip, identical, small_state, snapshot, step_dir
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
