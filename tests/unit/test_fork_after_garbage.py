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
from datetime import timedelta

from torch.distributed import TCPStore

_T = timedelta(seconds=10)


class _Cycle:
    def __init__(self, store: TCPStore) -> None:
        self.store = store
        self.me = self


def test_a_store_server_left_in_a_reference_cycle() -> None:
    # three: a child that collects one such store lived through it here, three never did
    held = [_Cycle(TCPStore("127.0.0.1", 0, is_master=True, timeout=_T)) for _ in range(3)]
    gc.collect()  # the cycle is old now (as the test's objects are after a while): only a
    held.clear()  # full collection frees it, and the parent may not run one for long


def test_a_child_forked_by_the_next_test_collects_its_garbage_and_lives() -> None:
    pid = os.fork()
    if pid == 0:
        gc.collect()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"the forked child died of signal {os.WTERMSIG(status)}"
        if os.WIFSIGNALED(status)
        else f"the forked child exited {os.WEXITSTATUS(status)}"
    )
