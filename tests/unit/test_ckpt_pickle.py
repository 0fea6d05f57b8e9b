"""Crafted pickles in a checkpoint never run (T-NO-CODE; issue 12).

Two places of a checkpoint are pickles: DCP's ``.metadata`` and the ``data.pkl`` inside each
tensor's ``torch.save`` blob. Each payload below would run ``touch MARKER`` when unpickled
the ordinary way (a control asserts that, so no payload is a dud). Planted in the newest
checkpoint with every checksum updated, as an attacker would, each must end in a refusal:
``ckpt verify`` calls the step damaged, ``restore()`` moves it aside and loads the older
step bit-identical, and the marker is never created.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptkit import (
    PROTO,
    STOP,
    build_root,
    copy_root,
    identical,
    p_call,
    p_global,
    p_stack_global,
    p_str,
    replace_blob,
    replace_file,
    small_state,
    snapshot,
    step_dir,
    tensor_blob,
)
from unbroken.ckpt import Checkpointer
from unbroken.ckpt.export import verify_steps

MD = "torch.distributed.checkpoint.metadata"


class _Evil:
    """Pickles as a call of ``os.system(cmd)`` (the ``__reduce__`` trick)."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def _touch(marker: str) -> str:
    return f"touch {marker}"


def _in_metadata(obj: Any) -> bytes:
    md = Metadata(state_dict_metadata={})
    md.planner_data = obj  # a genuine Metadata carrying the payload in a field
    return pickle.dumps(md, protocol=4)


# name -> marker path -> pickle bytes. Every one runs `touch MARKER` under plain pickle.
PAYLOADS: dict[str, Callable[[str], bytes]] = {
    "GLOBAL os.system": lambda m: p_call(p_global("os", "system"), _touch(m)) + STOP,
    "GLOBAL posix.system": lambda m: p_call(p_global("posix", "system"), _touch(m)) + STOP,
    "STACK_GLOBAL builtins.eval": lambda m: (
        PROTO
        + p_call(p_stack_global("builtins", "eval"), f"__import__('os').system({_touch(m)!r})")
        + STOP
    ),
    "STACK_GLOBAL builtins.exec": lambda m: (
        PROTO
        + p_call(p_stack_global("builtins", "exec"), f"import os; os.system({_touch(m)!r})")
        + STOP
    ),
    "INST subprocess.call": lambda m: (
        b"(]" + p_str("touch") + b"a" + p_str(m) + b"aisubprocess\ncall\n" + STOP
    ),
    "OBJ subprocess.check_call": lambda m: (
        PROTO
        + b"("
        + p_stack_global("subprocess", "check_call")
        + b"]"
        + p_str("touch")
        + b"a"
        + p_str(m)
        + b"ao"
        + STOP
    ),
    "dotted name under dcp.filesystem": lambda m: (
        PROTO
        + p_call(p_stack_global("torch.distributed.checkpoint.filesystem", "os.system"), _touch(m))
        + STOP
    ),
    "dotted name under dcp.metadata": lambda m: (
        PROTO + p_call(p_stack_global(MD, "torch.os.system"), _touch(m)) + STOP
    ),
    "dotted name under torch": lambda m: (
        PROTO + p_call(p_stack_global("torch", "os.system"), _touch(m)) + STOP
    ),
    "dotted name under pathlib": lambda m: (
        PROTO + p_call(p_stack_global("pathlib", "os.system"), _touch(m)) + STOP
    ),
    "__reduce__ of an object": lambda m: pickle.dumps(_Evil(_touch(m)), protocol=4),
    "__reduce__ inside a genuine Metadata": lambda m: _in_metadata(_Evil(_touch(m))),
    "BUILD state of an allowed class": lambda m: (
        PROTO
        + p_stack_global(MD, "Metadata")
        + b")\x81"  # EMPTY_TUPLE NEWOBJ: a Metadata instance
        + b"}"
        + p_str("planner_data")
        + p_call(p_global("os", "system"), _touch(m))
        + b"s"  # SETITEM
        + b"b"  # BUILD
        + STOP
    ),
    "REDUCE of an allowed callable, evil args": lambda m: (
        PROTO
        + p_stack_global("torch", "Size")
        + b"("
        + p_call(p_global("os", "system"), _touch(m))
        + b"\x85tR"  # TUPLE1 (the int list), args tuple, REDUCE
        + STOP
    ),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Any]]:
    root = str(tmp_path_factory.mktemp("pickle") / "pristine")
    return root, build_root(root)


def _control(payload: Callable[[str], bytes], tmp_path: Any, load: Callable[[bytes], Any]) -> None:
    """The payload is live: unpickled the ordinary way it creates its marker."""
    marker = str(tmp_path / "control-marker")
    try:
        load(payload(marker))
    except Exception:  # noqa: BLE001 - the side effect happens before any later error
        pass
    assert os.path.exists(marker), "payload is a dud: the test would prove nothing"
    os.unlink(marker)


def _restore_falls_back(root: str, want: dict[int, Any], marker: str, caplog: Any) -> list[str]:
    assert {v.step: v.ok for v in verify_steps(root)} == {2: True, 4: False}
    st, _, _ = small_state(seed=9)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        got = Checkpointer(root, st).restore()
    assert got == 2 and identical(snapshot(st), want[2])
    assert not os.path.exists(marker), "the crafted pickle ran"
    return [r.getMessage() for r in caplog.records if "step 4" in r.getMessage()]


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_crafted_dcp_metadata_is_refused_and_never_run(pristine, tmp_path, caplog, name) -> None:
    _control(PAYLOADS[name], tmp_path, pickle.loads)
    src, want = pristine
    root = str(tmp_path / "ck")
    copy_root(src, root)
    marker = str(tmp_path / "MARKER")
    replace_file(step_dir(root, 4), ".metadata", PAYLOADS[name](marker))
    warns = _restore_falls_back(root, want, marker, caplog)
    assert len(warns) == 1 and "metadata" in warns[0], warns


@pytest.mark.parametrize(
    "name",
    [
        "GLOBAL os.system",
        "STACK_GLOBAL builtins.eval",
        "__reduce__ of an object",
        "dotted name under torch",
    ],
)
def test_crafted_tensor_pickle_is_refused_and_never_run(pristine, tmp_path, caplog, name) -> None:
    weight = torch.zeros(32, 16)
    _control(
        PAYLOADS[name],
        tmp_path,
        lambda pkl: torch.load(io.BytesIO(tensor_blob(weight, pkl)), weights_only=False),
    )
    src, want = pristine
    root = str(tmp_path / "ck")
    copy_root(src, root)
    marker = str(tmp_path / "MARKER")
    blob = tensor_blob(weight, PAYLOADS[name](marker))
    replace_blob(step_dir(root, 4), "components/model/0.weight", blob)
    warns = _restore_falls_back(root, want, marker, caplog)
    assert len(warns) == 1 and "unreadable" in warns[0] and "weights_only" in warns[0], warns
