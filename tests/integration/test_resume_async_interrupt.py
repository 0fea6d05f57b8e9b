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

import torch

from ckptkit import small_state, train
from unbroken.ckpt import Checkpointer, read_checkpoint


def _waiting(thread_id: int) -> bool:
    """Is that thread inside ``Checkpointer.wait``?"""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == "wait" and "checkpointer" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def test_ctrl_c_while_waiting_then_save_keeps_each_step_its_own(tmp_path) -> None:
    st, m, opt = small_state()
    ck = Checkpointer(str(tmp_path), st, async_save=True, keep_last=None, quiet=True)
    train(st, m, opt, 2)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    gate = threading.Event()
    assert ck._pool is not None
    ck._pool.submit(gate.wait)  # the checkpoint thread is busy until the gate opens
    ck.save()  # step 2: queued behind the gate, its snapshot taken
    train(st, m, opt, 1)

    main = threading.get_ident()

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while not _waiting(main) and time.monotonic() < deadline:
            time.sleep(0.001)  # polling the condition, not waiting for it to happen
        signal.pthread_kill(main, signal.SIGINT)

    def release() -> None:
        """Let step 2 be written once the handler's save waits for it (or has returned)."""
        deadline = time.monotonic() + 60
        while not (_waiting(main) or saved.is_set()) and time.monotonic() < deadline:
            time.sleep(0.001)
        gate.set()

    helper = threading.Thread(target=interrupt)
    helper.start()
    try:
        ck.save()  # step 3 waits for step 2: Ctrl-C lands here
        raise AssertionError("the interrupt did not arrive while save() waited")
    except KeyboardInterrupt:
        pass
    helper.join()
    saved = threading.Event()
    opener = threading.Thread(target=release)
    opener.start()
    ck.save()  # the handler's save of step 3
    saved.set()
    opener.join()
    ck.close()

    got = read_checkpoint(str(tmp_path), 2)["components"]["model"]
    for k, v in want.items():
        assert torch.equal(got[k], v), f"step 2 holds another step's {k}"
    got3 = read_checkpoint(str(tmp_path), 3)["components"]["model"]
    for k, v in m.state_dict().items():
        assert torch.equal(got3[k], v), k
