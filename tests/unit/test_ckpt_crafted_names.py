"""Crafted step-directory names in a checkpoint root.

Our commit names a step ``step-%08d``. A directory whose name only looks like a step
(unpadded ``step-9``, a non-ASCII digit ``step-٤``, a second spelling ``step-000000004``
of a step already there) is someone else's: it must not become a candidate that names a
path which does not exist, a second entry for a step, or a step that retention deletes twice
(a save that raised ``FileNotFoundError`` after its commit).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from ckptkit import build_root, identical, small_state, snapshot, step_dir, train
from unbroken.ckpt import Checkpointer
from unbroken.ckpt.export import verify_steps

FOREIGN = ["step-9", "step-\u0664", "step-000000004", "step-\uff14", "step-4"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Any]]:
    r = str(tmp_path_factory.mktemp("names") / "ck")
    return r, build_root(r)


@pytest.mark.parametrize("name", FOREIGN)
def test_a_directory_only_named_like_a_step_is_not_one(pristine, tmp_path, name) -> None:
    src, want = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    foreign = os.path.join(root, name)
    shutil.copytree(step_dir(root, 2), foreign)  # a full copy: it even has a manifest

    assert [v.step for v in verify_steps(root, progress=False)] == [2, 4]
    st, m, opt = small_state(seed=9)
    ck = Checkpointer(root, st, keep_last=1)
    try:
        assert [i.step for i in ck.list()] == [2, 4]
        assert ck.latest() == 4
        assert ck.restore() == 4
        assert identical(snapshot(st), want[4])
        train(st, m, opt, 2)
        ck.save()  # retention deletes 2 and 4, each once, and never the foreign directory
    finally:
        ck.close()
    assert sorted(os.listdir(root)) == sorted(["step-00000006", name])
    assert sorted(os.listdir(foreign)) == sorted(os.listdir(os.path.join(src, "step-00000002")))


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_debris_named_like_retentions_own_never_fails_a_save(pristine, tmp_path, kind) -> None:
    """Retention renamed step N to the fixed ``.tmp-step-N.deleting`` before deleting it: an
    entry of that name the debris sweep cannot remove (a symlink, a file) made every save
    that pruned step N raise ``NotADirectoryError`` after its commit."""
    src, _ = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep\n")
    debris = os.path.join(root, ".tmp-step-00000002.deleting")
    if kind == "symlink":
        os.symlink(str(elsewhere), debris)
    else:
        with open(debris, "w") as f:
            f.write("x")

    st, m, opt = small_state(seed=9)
    ck = Checkpointer(root, st, keep_last=1)
    try:
        assert ck.restore() == 4
        train(st, m, opt, 2)
        ck.save()
    finally:
        ck.close()
    assert [n for n in os.listdir(root) if n.startswith("step-")] == ["step-00000006"]
    assert (elsewhere / "keep.txt").read_text() == "keep\n"
