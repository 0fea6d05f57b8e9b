"""A checkpoint root's ``.lock`` is a fixed name in an untrusted directory.

A root copied from elsewhere (or written by someone else) may hold a ``.lock`` that is a
symlink or a FIFO. The writer lock opened it read-write following symlinks and wrote the
holder's JSON into it after truncating it: a planted ``.lock -> ../notes.txt`` truncated
that file, outside the root, at the first ``restore()``. Every case asserts the target is
untouched and the error names the file and the fix; a FIFO never blocks the restore.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from ckptkit import build_root, small_state
from unbroken.ckpt import Checkpointer


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Any]]:
    r = str(tmp_path_factory.mktemp("lock") / "ck")
    return r, build_root(r)


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_a_symlinked_lock_never_writes_through(pristine, tmp_path, how) -> None:
    src, _ = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    os.symlink("../notes.txt" if how == "relative" else str(victim), os.path.join(root, ".lock"))

    st, _, _ = small_state(seed=9)
    ck = Checkpointer(root, st)
    try:
        with pytest.raises(RuntimeError, match=r"\.lock.*symlink.*remove it"):
            ck.restore()
    finally:
        ck.close()
    assert victim.read_text() == "precious\n"
    assert os.path.islink(os.path.join(root, ".lock"))


def test_a_fifo_as_lock_is_refused_without_blocking(pristine, tmp_path) -> None:
    src, _ = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    os.mkfifo(os.path.join(root, ".lock"))
    st, _, _ = small_state(seed=9)
    ck = Checkpointer(root, st)
    try:
        with pytest.raises(RuntimeError, match=r"\.lock.*not a regular file.*remove it"):
            ck.restore()
    finally:
        ck.close()
