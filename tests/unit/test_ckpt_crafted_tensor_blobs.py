"""Crafted ``torch.save`` blobs in a checkpoint's data file.

A tensor record in a layout unbroken does not write is read with
``torch.load(weights_only=True)``, which runs no code but builds whatever its allow-list
permits: ``torch.Size(bytearray(n))`` makes an 8·n-byte tuple from a 60-byte pickle, and a
zip record stored deflated is inflated to the size its directory claims; and unbroken's own
stand-in parse of ``data.pkl`` kept a copy of every call's arguments. Each case plants
one in step 4 (every offset and checksum re-signed, as an attacker would), restores, and
asserts step 2 loads bit-identical while the process's peak RSS stays under the bound
``2 * B + 256 MiB``. A blob in a foreign but honest layout (a transposed tensor, a view at
an offset of a larger storage) still loads.
"""

from __future__ import annotations

import io
import logging
import shutil
import struct
import tracemalloc
import zipfile
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckptkit import (
    PROTO,
    STOP,
    build_root,
    identical,
    p_global,
    replace_blob,
    restore_here,
    root_bytes,
    step_dir,
    tensor_blob,
)

MiB = 1 << 20
KEY = "components/model/0.weight"  # [32, 16] float32


def _size_of_bytearray(want: dict[int, Any]) -> bytes:
    # torch.Size(bytearray(2^26)): a 512 MiB tuple from a 60-byte pickle
    pkl = (
        b"\x80\x02"
        + p_global("torch", "Size")
        + p_global("builtins", "bytearray")
        + b"J"
        + struct.pack("<i", 1 << 26)
        + b"\x85R\x85R"
        + STOP
    )
    return tensor_blob(torch.zeros(32, 16), pkl)


def _calls_on_one_tuple(want: dict[int, Any]) -> bytes:
    # OrderedDict(*t) 600 times, t a memoized tuple of 100,000 items: 800 KB per call's copy
    pkl = (
        PROTO
        + b"("
        + b"N" * 100_000
        + b"t\x94"
        + p_global("collections", "OrderedDict")
        + b"\x94"
        + b"00]("
        + b"h\x01h\x00R" * 600
        + b"e"
        + STOP
    )
    return tensor_blob(torch.zeros(32, 16), pkl)


def _deflated_storage(want: dict[int, Any]) -> bytes:
    # a record of 2^27 float32 zeros (512 MiB) stored deflated: 0.5 MB in the file
    n = 1 << 27
    buf = io.BytesIO()
    torch.save(torch.zeros(7), buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            if info.filename.endswith("/data/0"):
                record = zipfile.ZipInfo(info.filename)
                record.compress_type = zipfile.ZIP_DEFLATED
                with zout.open(record, "w", force_zip64=True) as f:  # streamed: never whole here
                    zero = bytes(MiB)
                    for _ in range(n * 4 // MiB):
                        f.write(zero)
                continue
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                data = data.replace(b"K\x07", b"J" + struct.pack("<i", n))
            zout.writestr(info.filename, data)
    return out.getvalue()


def _honest(view: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[int, Any]], bytes]:
    """The same values saved as ``view(weight)``: not the layout unbroken writes."""

    def blob(want: dict[int, Any]) -> bytes:
        buf = io.BytesIO()
        torch.save(view(want[4]["components"]["model"]["0.weight"]), buf)
        return buf.getvalue()

    return blob


HONEST = {
    "transposed": _honest(lambda w: w.t().contiguous().t()),
    "at-a-storage-offset": _honest(
        lambda w: torch.cat([torch.ones(7), w.flatten()])[7:].view(32, 16)
    ),
}


BOMBS: dict[str, Callable[[dict[int, Any]], bytes]] = {
    "size-of-bytearray": _size_of_bytearray,
    "deflated-storage": _deflated_storage,
    "calls-on-one-tuple": _calls_on_one_tuple,
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Any]]:
    r = str(tmp_path_factory.mktemp("blobs") / "ck")
    return r, build_root(r)


def _restore(root: str, caplog: pytest.LogCaptureFixture) -> tuple[int | None, Any, int]:
    """The restored step, the live state, and the peak RSS the restore added."""
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        return restore_here(root)


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_crafted_tensor_blob_cannot_exhaust_memory(pristine, tmp_path, caplog, bomb) -> None:
    src, want = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    replace_blob(step_dir(root, 4), KEY, BOMBS[bomb](want))
    bound = 2 * root_bytes(root) + 256 * MiB

    got, state, peak = _restore(root, caplog)
    assert got == 2
    assert identical(state, want[2])
    assert any("step 4" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert peak < bound, f"{bomb}: restore peaked at {peak / MiB:.0f} MiB, bound {bound / MiB:.0f}"


@pytest.mark.parametrize("layout", sorted(HONEST))
def test_a_tensor_in_an_honest_foreign_layout_still_loads(
    pristine, tmp_path, caplog, layout
) -> None:
    src, want = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    replace_blob(step_dir(root, 4), KEY, HONEST[layout](want))
    got, state, _ = _restore(root, caplog)
    assert got == 4
    assert identical(state, want[4])


def _directory_bomb(n: int, zip64: bool) -> bytes:
    """A zip of nothing but ``n`` 46-byte central-directory entries."""
    entry = b"PK\x01\x02" + struct.pack(
        "<6H3I5H2I", 20, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    )
    cd = entry * n
    if not zip64:
        return cd + b"PK\x05\x06" + struct.pack("<4H2IH", 0, 0, n, n, len(cd), 0, 0)
    z64 = b"PK\x06\x06" + struct.pack("<QHHIIQQQQ", 44, 45, 45, 0, 0, n, n, len(cd), 0)
    locator = b"PK\x06\x07" + struct.pack("<IQI", 0, len(cd), 1)
    end = b"PK\x05\x06" + struct.pack("<4H2IH", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return cd + z64 + locator + end


@pytest.mark.parametrize("zip64", [False, True], ids=["zip", "zip64"])
def test_a_zip_directory_of_many_records_is_no_tensor_blob(zip64) -> None:
    """A tensor blob's zip lists five records; one listing 50,000 made the reader build a
    ZipInfo of ~400 bytes for each 46-byte entry (8x the file: 8 GiB for a 1 GiB chunk)."""
    from unbroken.ckpt.tensor_io import _zip_entries

    blob = _directory_bomb(50_000, zip64)
    tracemalloc.start()
    try:
        got = _zip_entries(memoryview(blob))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == []
    assert peak < len(blob), f"parsing a {len(blob)}-byte directory peaked at {peak} bytes"
