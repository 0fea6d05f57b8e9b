"""A checkpoint writer driven over stdin, for the one-writer tests (C-ONE-WRITER).

Usage: ``python ckpt_writer.py ROOT MARK``. Restores ROOT (taking the writer lock), prints
``ready <restored step or None>``, then obeys one command per line:

* ``save N``: save step N (its tensor is filled with ``MARK + N``), print ``saved N``;
* ``save-stop N``: the same, but the process stops itself (SIGSTOP) right before the commit,
  when the temp dir holds every file of step N; it prints ``stopping <temp dir>`` first;
* ``exit``: close the checkpointer and exit 0.

A refused lock (another writer holds ROOT) ends the process with status 3 and the error on
stderr.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from unbroken.ckpt import Checkpointer, TrainState
from unbroken.ckpt.manifest import CheckpointManifest
from unbroken.ckpt.store import Store


class Values:
    """A 1024-float tensor: its value identifies the writer and the step."""

    def __init__(self) -> None:
        self.t = torch.zeros(1024)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.t.copy_(sd["t"])


def main() -> int:
    root, mark = sys.argv[1], float(sys.argv[2])
    stop_at: list[int] = []
    commit = Store.commit

    def stopping_commit(self: Store, tmp: str, step: int, manifest: CheckpointManifest) -> str:
        if step in stop_at:
            print(f"stopping {tmp}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return commit(self, tmp, step, manifest)

    Store.commit = stopping_commit  # type: ignore[method-assign]
    v = Values()
    st = TrainState(extras={"v": v})
    ck = Checkpointer(root, st, keep_last=None)
    try:
        restored = ck.restore()
    except RuntimeError as e:
        print(e, file=sys.stderr, flush=True)
        return 3
    print(f"ready {restored}", flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "exit":
            break
        step = int(arg[0])
        if cmd == "save-stop":
            stop_at.append(step)
        v.t.fill_(mark + step)
        st.step = step
        ck.save()
        print(f"saved {step}", flush=True)
    ck.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
