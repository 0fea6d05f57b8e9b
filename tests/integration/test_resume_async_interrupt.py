"""C-ASYNC: a Ctrl-C while the loop waits for the save in flight must not let the next
save overwrite the buffers that save is still writing.

The pattern: ``except KeyboardInterrupt: ckpt.save()``. When the interrupt lands in
``wait()`` (a save waits for the previous one), ``wait`` had already forgotten the save in
flight, so the handler's save snapshotted into the same host buffers while the background
thread was still writing them: step N was committed holding step N+1's tensors, with
matching checksums (a mixed checkpoint that verifies). The checkpoint thread is held on a
real event so the interrupt lands while the save is in flight; the interrupt is a real
SIGINT sent to the main thread once it waits.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from ckptkit import small_state, train
from unbroken.ckpt import Checkpointer, TrainState, read_checkpoint


def _waiting(thread_id: int, module: str = "checkpointer") -> bool:
    """Is that thread inside the ``wait`` of ``unbroken/ckpt/<module>.py``?"""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wait" and code.co_filename.endswith(f"ckpt/{module}.py"):
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Holds a checkpoint thread until opened; opened at the end whatever happened (a thread
    left waiting on it hung the worker process later, in a Checkpointer's finalizer)."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture(autouse=True)
def _sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt during these tests: a process started with SIGINT
    ignored (a background job of a shell: ``cmd &``) has no Python handler for it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupt_when_waiting(main: int, module: str, gate: threading.Event) -> Callable[[], str]:
    """A real SIGINT to the main thread once it waits in ``module``'s ``wait``. Should the
    interrupt not end the wait within 60 s, ``gate`` is opened (the test then fails on its
    own assertion instead of hanging); the callable this returns joins the helper and gives
    the main thread's signal state as the kernel saw it then (empty when all went well)."""
    native = threading.get_native_id()
    seen: list[str] = []

    def run() -> None:
        deadline = time.monotonic() + 60
        while not _waiting(main, module) and time.monotonic() < deadline:
            time.sleep(0.001)  # polling the condition, not waiting for it to happen
        signal.pthread_kill(main, signal.SIGINT)
        deadline = time.monotonic() + 60
        while _waiting(main, module) and time.monotonic() < deadline:
            time.sleep(0.01)
        if _waiting(main, module):
            with open(f"/proc/self/task/{native}/status") as f:
                seen.extend(ln.strip() for ln in f if ln.startswith(("Sig", "Shd")))
            gate.set()

    helper = threading.Thread(target=run)
    helper.start()

    def done() -> str:
        helper.join()
        return "; ".join(seen)

    return done


def _open_when_waiting(main: int, module: str, gate: threading.Event) -> Callable[[], None]:
    """Open ``gate`` once the main thread waits in ``module``'s ``wait`` or has gone past
    the call (returned: the callable this returns); that callable joins the helper."""
    past = threading.Event()

    def run() -> None:
        deadline = time.monotonic() + 60
        while not (_waiting(main, module) or past.is_set()) and time.monotonic() < deadline:
            time.sleep(0.001)
        gate.set()

    helper = threading.Thread(target=run)
    helper.start()

    def done() -> None:
        past.set()
        helper.join()

    return done


def test_ctrl_c_while_waiting_then_save_keeps_each_step_its_own(tmp_path, gate) -> None:
    st, m, opt = small_state()
    ck = Checkpointer(str(tmp_path), st, async_save=True, keep_last=None, quiet=True)
    train(st, m, opt, 2)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    assert ck._pool is not None
    ck._pool.submit(gate.wait)  # the checkpoint thread is busy until the gate opens
    ck.save()  # step 2: queued behind the gate, its snapshot taken
    train(st, m, opt, 1)

    main = threading.get_ident()
    interrupted = _interrupt_when_waiting(main, "checkpointer", gate)
    try:
        ck.save()  # step 3 waits for step 2: Ctrl-C lands here
        raise AssertionError(f"no interrupt while save() waited: {interrupted()}")
    except KeyboardInterrupt:
        pass
    assert interrupted() == ""
    done = _open_when_waiting(main, "checkpointer", gate)
    try:
        ck.save()  # the handler's save of step 3
    finally:
        done()
    ck.close()

    got = read_checkpoint(str(tmp_path), 2)["components"]["model"]
    for k, v in want.items():
        assert torch.equal(got[k], v), f"step 2 holds another step's {k}"
    got3 = read_checkpoint(str(tmp_path), 3)["components"]["model"]
    for k, v in m.state_dict().items():
        assert torch.equal(got3[k], v), k


def test_ctrl_c_while_a_memory_publish_waits_then_save_succeeds(tmp_path, gate) -> None:
    """The memory tier's ``wait`` forgot the publish in flight the same way: the handler's
    save then began a publish while the previous one was unfinished, and failed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1500, 1500)  # 9 MB: its slot is checksummed in the tier's thread
    st = TrainState(model=model)
    ck = Checkpointer(
        str(tmp_path / "ck"), st, every_steps=1000, memory_every_steps=1,
        memory_dir=str(tmp_path / "mem"), quiet=True,
    )  # fmt: skip

    def step() -> None:
        with torch.no_grad():
            model.weight.add_(1.0)
        st.step += 1

    step()
    ck.maybe_save()  # step 1: the first publish
    ck.wait()
    memory = ck._memory
    assert memory is not None and memory._finisher is not None
    memory._finisher.submit(gate.wait)  # the tier's thread is busy until the gate opens
    step()
    ck.maybe_save()  # step 2: copied into its slot, its checksum queued behind the gate
    step()
    main = threading.get_ident()
    interrupted = _interrupt_when_waiting(main, "memtier", gate)
    try:
        ck.maybe_save()  # step 3's publish waits for step 2's: Ctrl-C lands here
        raise AssertionError(f"no interrupt while the publish waited: {interrupted()}")
    except KeyboardInterrupt:
        pass
    assert interrupted() == ""
    want = model.weight.detach().clone()
    done = _open_when_waiting(main, "memtier", gate)
    try:
        ck.save()  # the handler's save of step 3
    finally:
        done()
    ck.close()
    assert torch.equal(
        read_checkpoint(str(tmp_path / "ck"), 3)["components"]["model"]["weight"], want
    )
