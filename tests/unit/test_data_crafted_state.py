"""Crafted loader states (D-RESUME, T-NO-WRONG-BYTE): a state dict comes from a checkpoint
file, so ``StatefulLoader.load_state_dict`` takes it as untrusted input. Every field of the
wrong type or range is a ``ValueError`` naming the field and its value - never an
``OverflowError`` from deep inside, never a float or string silently truncated into a
position that the loop then trains on - and text from the state is printed escaped.
"""

from __future__ import annotations

from typing import Any

import pytest

from datakit import build_tar_dataset
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.stream.loader import StatefulLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _keys(batch: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in batch]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tar_dataset(str(tmp_path_factory.mktemp("tar") / "ds"), 24, shard_size=12_000)


def _loader(root: str) -> StatefulLoader:
    ds = StreamingDataset(root, seed=0)
    return StatefulLoader(ds, batch_size=4, num_workers=0, collate_fn=_keys)


BAD = [
    ("epoch", float("inf")),
    ("epoch", float("nan")),
    ("epoch", 1.9),
    ("epoch", True),
    ("epoch", "3"),
    ("epoch", -1),
    ("epoch", 2**63),
    ("epoch", 10**30),
    ("samples_consumed", float("inf")),
    ("samples_consumed", 4.5),
    ("samples_consumed", "8"),
    ("samples_consumed", -1),
    ("samples_consumed", 25),
    ("seed", 0.4),
    ("seed", False),
    ("version", 1.5),
    ("version", float("inf")),
    ("shuffle_window", [24.9]),
    ("shuffle_window", "24"),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_a_bad_field_is_a_value_error_naming_it_and_the_position_is_kept(root, field, value):
    ld = _loader(root)
    good = ld.state_dict()
    ld.load_state_dict(dict(good, epoch=1, samples_consumed=8))
    with pytest.raises(ValueError) as ei:
        ld.load_state_dict(dict(good, **{field: value}))
    assert type(ei.value) is ValueError, repr(ei.value)  # not an OverflowError's cousin
    assert field in str(ei.value), str(ei.value)
    # nothing changed: the loader still stands where the last good state put it
    assert (ld.epoch, ld.samples_consumed) == (1, 8)


def test_good_states_still_load(root):
    """The checks refuse the wrong types only: every position of a real run loads."""
    ld = _loader(root)
    want = [next(iter(ld))]
    st = ld.state_dict()
    ld2 = _loader(root)
    ld2.load_state_dict(st)
    assert ld2.state_dict() == st
    ld3 = _loader(root)
    ld3.load_state_dict(dict(ld3.state_dict(), epoch=0, samples_consumed=0))
    assert [next(iter(ld3))] == want


def test_text_from_the_state_is_printed_escaped(root):
    """A fingerprint or a source's fingerprint in the state is file content: an ANSI escape
    in it reaches the error message as a visible escape, not as a control character."""
    ld = _loader(root)
    st = dict(
        ld.state_dict(),
        fingerprint="\x1b[2J\x1b[32mVERIFIED",
        sources=[{"fingerprint": "\x1b[31m\u202e"}],
        windows="fixed",
    )
    with pytest.raises(ValueError) as ei:
        ld.load_state_dict(st)
    msg = str(ei.value)
    assert "\x1b" not in msg and "\u202e" not in msg and "\\x1b" in msg, msg
    with pytest.raises(ValueError) as ei:
        ld.load_state_dict(dict(ld.state_dict(), windows="\x1b[31mrandom"))
    assert "\x1b" not in str(ei.value), str(ei.value)
