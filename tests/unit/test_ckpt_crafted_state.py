"""Crafted values in a rank's state file.

The state file is JSON whose tagged values the codec decodes before the schema checks run.
A numpy scalar's dtype comes from the file: ``{"dtype": "V1", "value": 1073741824}`` made
``np.void(1073741824)``, a zero-filled GiB from a 60-byte value. Planted in step 4 (the
file's checksum re-signed), the restore must load step 2 bit-identical within the bound
``2 * B + 256 MiB``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import pytest

from ckptkit import build_root, edit_state, identical, restore_here, root_bytes, step_dir

MiB = 1 << 20
BOMB = {"__ub__": "npscalar", "dtype": "V1", "value": 1 << 30}


def _in_state(b: dict[str, Any]) -> None:
    b["state"]["components"]["scheduler"]["base_lrs"] = [BOMB]


def _in_rng(b: dict[str, Any]) -> None:
    b["rng"]["python"] = BOMB


PLACES: dict[str, Callable[[dict[str, Any]], None]] = {"state": _in_state, "rng": _in_rng}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Any]]:
    r = str(tmp_path_factory.mktemp("state") / "ck")
    return r, build_root(r)


@pytest.mark.parametrize("place", sorted(PLACES))
def test_a_numpy_scalar_of_a_crafted_size_is_damage_not_memory(pristine, tmp_path, place) -> None:
    src, want = pristine
    root = str(tmp_path / "ck")
    shutil.copytree(src, root, symlinks=True)
    edit_state(step_dir(root, 4), PLACES[place])
    bound = 2 * root_bytes(root) + 256 * MiB

    got, live, peak = restore_here(root)
    assert got == 2
    assert identical(live, want[2])
    assert peak < bound, f"restore peaked at {peak / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
