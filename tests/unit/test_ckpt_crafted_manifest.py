"""Crafted, re-signed manifest fields that made validation raise something other than
:class:`ManifestError`.

``restore()`` turns any exception of the verified reader into damage, but the archive
(``parse_manifest``) and ``ckpt ls``/``inspect`` catch only ``ManifestError``: a rank key
``"²"`` (``isdigit()`` but not ``int()``), a number beyond a float, a tensor of more
dimensions than numpy's 64, an integer of more digits than
Python converts (a plain ``ValueError`` from ``json.loads``) made a remote step that should be skipped end the restore in a
traceback. Each case asserts ``from_json`` raises ``ManifestError`` naming the field, a
local restore falls back to step 2, and a restore from an archive whose newest step
carries it downloads step 2 instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
import pytest

from ckptkit import build_root, identical, small_state, snapshot, step_dir
from unbroken.ckpt import ArchiveConfig, Checkpointer
from unbroken.ckpt.archive.remote import Archive
from unbroken.ckpt.manifest import CheckpointManifest, ManifestError, manifest_digest

W = "components/model/0.weight"  # [32, 16] float32


def _rank_key(m: dict[str, Any]) -> None:
    m["ranks"]["\u00b2"] = m["ranks"].pop("0")


def _created(m: dict[str, Any]) -> None:
    m["created"] = 10**400


def _stats(m: dict[str, Any]) -> None:
    m["tensors"][W]["stats"] = {"sum": 10**400, "norm": 1.0}


def _long_number(m: dict[str, Any]) -> None:
    m["created"] = 12345.5  # replaced by a 5,000-digit integer in the text (see _crafted)


def _many_dims(m: dict[str, Any]) -> None:
    # the same 512 elements in 67 dimensions, as two shards of 256
    t = m["tensors"][W]
    c = t["chunks"][0]
    half = dict(c, offsets=[0] * 67, sizes=[1] * 65 + [16, 16], length=c["length"] // 2)
    rest = dict(half, offsets=[0] * 65 + [16, 0], offset=c["offset"] + half["length"])
    rest["length"] = c["length"] - half["length"]
    t.update(shape=[1] * 65 + [32, 16], sharded=True, checksum=None, chunks=[half, rest])


EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "rank-key-superscript": (_rank_key, "ranks"),
    "created-beyond-float": (_created, "created"),
    "stats-beyond-float": (_stats, "stats"),
    "67-dimensions": (_many_dims, "dimensions"),
    "5000-digit-number": (_long_number, "JSON"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Any]]:
    r = str(tmp_path_factory.mktemp("manifest") / "ck")
    return r, build_root(r)


def _crafted(src: str, name: str) -> bytes:
    """Step 4's manifest with edit ``name``, re-signed as an attacker would."""
    with open(os.path.join(step_dir(src, 4), "manifest.json"), "rb") as f:
        m = json.loads(f.read())
    EDITS[name][0](m)
    m["manifest_checksum"] = manifest_digest(m)
    return json.dumps(m).encode().replace(b"12345.5", b"1" * 5000)


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_crafted_field_is_a_manifest_error(pristine, name) -> None:
    src, _ = pristine
    field = EDITS[name][1]
    with pytest.raises(ManifestError, match=field):
        CheckpointManifest.from_json(_crafted(src, name), step=4, where="manifest.json")


@pytest.mark.parametrize("name", sorted(EDITS))
def test_restore_falls_back_past_it_locally(pristine, tmp_path, caplog, name) -> None:
    src, want = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    with open(os.path.join(step_dir(root, 4), "manifest.json"), "wb") as f:
        f.write(_crafted(src, name))
    st, _, _ = small_state(seed=9)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        assert Checkpointer(root, st).restore() == 2
    assert identical(snapshot(st), want[2])


@pytest.mark.parametrize("name", sorted(EDITS))
def test_restore_from_the_archive_falls_back_past_it(pristine, tmp_path, caplog, name) -> None:
    src, want = pristine
    url = f"memory://crafted-{uuid.uuid4().hex[:8]}"
    for s in (2, 4):
        Archive(url).upload(step_dir(src, s), s)
    with fsspec.open(f"{url}/step-00000004/manifest.json", "wb") as f:
        f.write(_crafted(src, name))

    st, _, _ = small_state(seed=9)
    ck = Checkpointer(str(tmp_path / "empty"), st, archive=ArchiveConfig(url))
    try:
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            assert ck.restore() == 2
    finally:
        ck.close()
    assert identical(snapshot(st), want[2])
    assert any("step 4" in r.getMessage() for r in caplog.records)
