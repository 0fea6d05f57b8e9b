"""A test that leaves a torch ``TCPStore`` server in a reference cycle (a ``pytest.raises``
traceback holding the test's frame is enough) must not kill a later test's forked children.

A forked child that garbage-collects an inherited store server segfaults (its destructor
stops an event-loop thread the child does not have). CI saw both DataLoader workers of
``test_stream_held_epochs.py`` die so, in an xdist worker that had run
``test_shared_rdzv_state.py`` earlier. ``conftest.py`` collects the garbage of a test that
leaves more threads than it found; these two tests, run in this order, prove it does.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from datetime import timedelta

from torch.distributed import TCPStore

_T = timedelta(seconds=10)


class _Cycle:
    def __init__(self, store: TCPStore) -> None:
        self.store = store
        self.me = self


def _stores_in_an_old_cycle() -> list[_Cycle]:
    """Three store servers in reference cycles, old (as a test's objects are after a while):
    clear the list and only a full collection frees them, which the parent may not run for
    long. Three: a child that collects one such store lived through it here, three never did."""
    held = [_Cycle(TCPStore("127.0.0.1", 0, is_master=True, timeout=_T)) for _ in range(3)]
    gc.collect()
    return held


def _child_collects() -> str:
    """Fork a child that runs a full collection: how it ended."""
    pid = os.fork()
    if pid == 0:
        gc.collect()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"the forked child died of signal {os.WTERMSIG(status)}"
    return f"the forked child exited {os.WEXITSTATUS(status)}"


def test_a_store_server_left_in_a_reference_cycle() -> None:
    _stores_in_an_old_cycle().clear()


def test_a_child_forked_by_the_next_test_collects_its_garbage_and_lives() -> None:
    said = _child_collects()
    assert said == "the forked child exited 0", said


_LEAVES = """
import pytest
from test_fork_after_garbage import _stores_in_an_old_cycle


@pytest.fixture(scope="module")
def stores():
    held = _stores_in_an_old_cycle()
    yield
    held.clear()


def test_uses_them(stores):
    pass
"""

_FORKS = """
from test_fork_after_garbage import _child_collects


def test_fork():
    said = _child_collects()
    assert said == "the forked child exited 0", said
"""


def test_what_a_module_fixture_leaves_is_collected_before_the_next_file(tmp_path) -> None:
    """The module-scoped half of the guard: a file whose module fixture leaves store servers
    in a cycle when it ends; the next file forks. With conftest.py the child lives; with the
    module-scoped guard taken out of it, the child dies (the test can fail)."""
    unit = os.path.dirname(os.path.abspath(__file__))
    here = os.path.dirname(unit)
    with open(os.path.join(here, "conftest.py")) as f:
        conftest = f.read()
    guard = '@pytest.fixture(autouse=True, scope="module")\n'
    assert guard in conftest
    outcomes = {}
    for name, text in (("with", conftest), ("without", conftest.replace(guard, ""))):
        d = tmp_path / name
        d.mkdir()
        (d / "conftest.py").write_text(text)
        (d / "test_a_leaves.py").write_text(_LEAVES)
        (d / "test_b_forks.py").write_text(_FORKS)
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
            cwd=d,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([here, unit, *sys.path])},
        )
        outcomes[name] = (r.returncode, r.stdout[-1500:])
    assert outcomes["with"][0] == 0, outcomes["with"][1]
    assert outcomes["without"][0] == 1 and "signal 11" in outcomes["without"][1], outcomes
