"""Shared fixtures. The data builders live in ``tests/datakit.py``."""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Callable, Iterator

import pytest

from datakit import build_tar_dataset, build_token_dataset


@pytest.fixture(scope="session")
def stream_data(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``stream_data(name)`` -> a dataset directory, built once per session:
    ``tar`` (203 samples in ~55 shards of 2-4), ``tar_b`` (61 samples, keys ``b*``),
    ``tokens`` (seq_len 8, ~120 sequences in 5 shards)."""
    base = tmp_path_factory.mktemp("stream-data")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            out = str(base / name)
            if name == "tar":
                build_tar_dataset(out, 203)
            elif name == "tar_b":
                build_tar_dataset(out, 61, prefix="b")
            elif name == "tokens":
                build_token_dataset(out, 5, 200, seq_len=8)
            else:
                raise KeyError(name)
            built[name] = out
        return built[name]

    return get


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: nothing to compare
        return 0


def _collect_if_threads_were_left() -> Iterator[None]:
    before = _native_threads()
    yield
    if _native_threads() > before:
        gc.collect()


@pytest.fixture(autouse=True)
def _garbage_of_a_test_that_left_threads_is_collected() -> Iterator[None]:
    """A test that leaves more threads than it found gets its garbage collected at once.

    An object that owns threads (a torch ``TCPStore`` server, a process group) left in a
    reference cycle (e.g. by a ``pytest.raises`` traceback holding the test's frame) is
    inherited by every child a later test forks; a child that collects it segfaults (its
    destructor stops threads the child does not have): CI lost both DataLoader workers of a
    later test file so. A full collection only then costs nothing on the other tests."""
    yield from _collect_if_threads_were_left()


@pytest.fixture(autouse=True, scope="module")
def _garbage_of_a_module_that_left_threads_is_collected() -> Iterator[None]:
    """The same for what a test file's module-scoped fixtures leave when they end."""
    yield from _collect_if_threads_were_left()


_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@pytest.fixture(autouse=True)
def _stop_signals_left_as_found() -> Iterator[None]:
    """A test (or the code under test) that leaves a stop signal's handler or mask changed
    breaks the later tests of its worker process (a SIGINT that no longer raised hung one for
    300 s in CI) and, in a user's process, swallows the signal: restored, and the test errors."""
    handlers = {s: signal.getsignal(getattr(signal, s)) for s in _STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    changed = []
    for s, h in handlers.items():
        now = signal.getsignal(getattr(signal, s))
        if now != h:
            changed.append(f"{s} handler {h!r} -> {now!r}")
            signal.signal(getattr(signal, s), h)
    now_mask = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if now_mask != mask:
        changed.append(f"blocked signals {sorted(mask)} -> {sorted(now_mask)}")
    if changed:
        pytest.fail("left changed: " + "; ".join(changed), pytrace=False)
