"""Crafted DCP ``.metadata`` pickles that copy one object many times.

The opcode walk (``bounds.pickle_cost``) charges what each opcode allocates, but three
steps of the stand-in parse used to copy an object the pickle built once and memoized:
``torch.Size`` applied as the builtin ``tuple`` (``tuple(b)`` of a 1 MiB ``bytes`` is an
8 MiB tuple), ``BUILD`` into a stand-in (a dict state copied into each instance), and an
allow-listed call (``PosixPath(*args)`` keeps a copy of its arguments). Each costs a few
bytes of file per copy, so a 1 MB ``.metadata`` could allocate gigabytes. Each case
plants one in step 4 of a real root, restores under ``tracemalloc``, and asserts step 2
loads bit-identical and the parse stayed under ``2 * B + 256 MiB``.
"""

from __future__ import annotations

import logging
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from ckptkit import (
    PROTO,
    STOP,
    build_root,
    identical,
    p_global,
    replace_file,
    root_bytes,
    small_state,
    snapshot,
    step_dir,
)
from unbroken.ckpt import Checkpointer

MiB = 1 << 20
_MD = "torch.distributed.checkpoint.metadata"


def _memoized(obj: bytes) -> bytes:
    """Build ``obj``, keep it in memo slot 0, pop it."""
    return PROTO + obj + b"\x94" + b"0"


def _each(copy: bytes, k: int) -> bytes:
    """A list holding ``k`` results of ``copy`` (which reads memo slot 0)."""
    return b"](" + copy * k + b"e" + STOP


def _size_of_bytes() -> bytes:
    # torch.Size(b) where b is 1 MiB of bytes: 8 MiB per copy, 80 copies
    big = b"B" + struct.pack("<I", MiB) + bytes(MiB)
    return _memoized(big) + _each(p_global("torch", "Size") + b"h\x00\x85R", 80)


def _build_from_one_dict() -> bytes:
    # one dict of 50,000 entries BUILT into 200 stand-in instances
    d = b"}(" + b"".join(b"J" + struct.pack("<i", i) + b"N" for i in range(50_000)) + b"u"
    stub = p_global(_MD, "StorageMeta") + b")\x81"
    return _memoized(d) + _each(stub + b"h\x00b", 200)


def _call_with_many_args() -> bytes:
    # PosixPath(*t) where t holds 300,000 items: 2.4 MB kept per call, 200 calls
    t = b"(" + b"N" * 300_000 + b"t"
    return _memoized(t) + _each(p_global("pathlib", "PosixPath") + b"h\x00R", 200)


BOMBS: dict[str, Callable[[], bytes]] = {
    "size-of-bytes": _size_of_bytes,
    "build-from-one-dict": _build_from_one_dict,
    "call-with-many-args": _call_with_many_args,
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Any]]:
    r = str(tmp_path_factory.mktemp("bombs") / "ck")
    return r, build_root(r)


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_metadata_pickle_copying_one_object_is_bounded(pristine, tmp_path, caplog, bomb) -> None:
    src, want = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    replace_file(step_dir(root, 4), ".metadata", BOMBS[bomb]())
    bound = 2 * root_bytes(root) + 256 * MiB

    st, _, _ = small_state(seed=9)
    ck = Checkpointer(root, st)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            got = ck.restore()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        ck.close()
    assert got == 2
    assert identical(snapshot(st), want[2])
    assert any("step 4" in r.getMessage() and ".metadata" in r.getMessage() for r in caplog.records)
    assert peak < bound, f"{bomb}: parsing peaked at {peak / MiB:.0f} MiB, bound {bound / MiB:.0f}"
