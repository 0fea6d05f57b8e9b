"""The per-rank decisions (compare, rename, world-size rule) and the writer lock's
process semantics (shared in a process, not inherited by forked children, and a dead
writer's children holding it for a moment delay its successor but never let it in early)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from unbroken.ckpt import TrainState, codec, lock, per_rank
from unbroken.ckpt.manifest import CheckpointManifest, split_key


class _Box:
    def __init__(self) -> None:
        self.t = torch.zeros(2)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.t.copy_(sd["t"])


def _fp(rank: int) -> dict[str, dict[str, str]]:
    tensors = {
        "components/model/w": torch.ones(3),  # equal on every rank
        "components/extra.h/t": torch.full((2,), float(rank)),  # per rank
    }
    tree = {"model": {"w": {}}, "extra.h": {"t": {}, "n": rank}}
    return per_rank.fingerprints(tree, tensors, {"model": "replicated", "extra.h": "per_rank"})


def test_compare_names_what_differs_and_rename_points_each_rank_at_its_copy() -> None:
    differing = per_rank.compare([_fp(0), _fp(1)])
    assert differing == {"extra.h": [per_rank.NON_TENSOR, "components/extra.h/t"]}
    assert per_rank.compare([_fp(0), _fp(0)]) == {}
    # what only some ranks have differs: each keeps its own
    assert per_rank.compare([_fp(0), {}]) == {
        "extra.h": [per_rank.NON_TENSOR, "components/extra.h/t"],
        "model": ["components/model/w"],
    }
    tensors = {"components/extra.h/t": torch.zeros(2), "components/model/w": torch.ones(3)}
    tree = codec.encode({"components": {"extra.h": {"t": tensors["components/extra.h/t"]}}}, {})
    tree2, tensors2 = per_rank.rename(tree, tensors, differing, 1)
    assert set(tensors2) == {"rank1/components/extra.h/t", "components/model/w"}
    assert codec.tensor_keys(tree2) == {"rank1/components/extra.h/t"}
    assert split_key("rank1/components/extra.h/t") == (1, "components/extra.h/t")


def _manifest(world: int, differs: dict[str, bool] | None) -> CheckpointManifest:
    extra = {}
    if differs is not None:
        comps = {n: {"sharing": "?", "differs": d, "differing": []} for n, d in differs.items()}
        extra["components"] = comps
    return CheckpointManifest(9, world, {}, {}, {}, {}, extra=extra)


def test_world_size_rule(caplog) -> None:
    m = torch.nn.Linear(2, 2)
    st = TrainState(model=m, extras={"h": _Box(), "s": _Box()}, replicated=["extra.s"])
    differs = {"model": False, "extra.h": True, "extra.s": True}
    assert per_rank.check_resize(_manifest(2, differs), st, 2, 0) == set()  # same world
    with pytest.raises(ValueError, match=r"saved by 2 ranks.*has 1.*\['extra\.h'\]"):
        per_rank.check_resize(_manifest(2, differs), st, 1, 0)
    st.per_rank_on_resize = "skip"
    with caplog.at_level(logging.WARNING):
        assert per_rank.check_resize(_manifest(2, differs), st, 1, 0) == {"extra.h"}
    text = " | ".join(r.getMessage() for r in caplog.records)
    assert "['extra.h'] not restored" in text and "['extra.s'] differed" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # saved by one rank: copied to all, said by name
        same = {"model": False, "extra.h": False, "extra.s": False}
        assert per_rank.check_resize(_manifest(1, same), st, 2, 0) == set()
    assert "['extra.h'] was saved by a single rank" in caplog.text
    assert per_rank.check_resize(_manifest(2, None), st, 1, 0) == set()  # no section: as before


def test_writer_lock_is_shared_in_a_process_and_knows_its_temp_dirs(tmp_path) -> None:
    root = str(tmp_path / "ck")
    tmp = os.path.join(root, ".tmp-step-00000001.abcdef12")
    assert lock.writer_alive(tmp)  # no lock here: nobody can tell, so never delete
    a = lock.acquire(root)
    b = lock.acquire(root)  # the same process is the same writer
    assert not lock.writer_alive(tmp)  # we hold the lock and did not create it: debris
    lock.note_temp(tmp)
    assert lock.writer_alive(tmp)
    lock.note_temp(tmp, done=True)
    a.release()
    a.release()  # idempotent
    assert os.path.exists(os.path.join(root, lock.LOCK_NAME))  # b still holds it
    b.release()
    assert os.listdir(root) == []  # the holder removes the file when it lets go
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        lock.acquire(str(tmp_path / "f"))


def _holder(root: str, ready: mp.synchronize.Event) -> None:
    lock.acquire(root)
    child = mp.get_context("fork").Process(target=signal.pause)  # e.g. a DataLoader worker
    child.start()
    with open(os.path.join(root, "child.pid"), "w") as f:
        f.write(str(child.pid))
    ready.set()
    signal.pause()


def test_a_forked_child_does_not_keep_a_killed_writers_lock(tmp_path) -> None:
    root = str(tmp_path / "ck")
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_holder, args=(root, ready))
    p.start()
    assert p.pid is not None
    assert ready.wait(60)
    child = int(open(os.path.join(root, "child.pid")).read())
    try:
        with pytest.raises(lock.RootLocked, match=f"pid {p.pid}"):
            lock.acquire(root)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        os.kill(child, 0)  # the forked child lives on, holding a copy of the fd table
        lease = lock.acquire(root)  # free at once all the same
        lease.release()
    finally:
        os.kill(child, signal.SIGKILL)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _let_go_on_cue(fd: int, cue: int) -> None:
    os.read(cue, 1)
    os.close(fd)
    signal.pause()


def _holder_with_a_slow_child(root: str, ready: mp.synchronize.Event, cue: int) -> None:
    lock.acquire(root)
    # A forked child that has not run yet still holds the open file the lock belongs to.
    # Stand in for it, deterministically: a copy the fork hook does not know about, which
    # the child drops only when the test says so.
    copy = os.dup(lock._HELD[lock._key(root)].fd)  # type: ignore[arg-type]
    child = mp.get_context("fork").Process(target=_let_go_on_cue, args=(copy, cue))
    child.start()
    os.close(copy)
    with open(os.path.join(root, "child.pid"), "w") as f:
        f.write(str(child.pid))
    ready.set()
    signal.pause()


def test_a_killed_writers_slow_child_delays_its_successor_but_never_lets_it_in_early(
    tmp_path, monkeypatch, caplog
) -> None:
    root = str(tmp_path / "ck")
    cue_r, cue_w = os.pipe()
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_holder_with_a_slow_child, args=(root, ready, cue_r))
    p.start()
    assert p.pid is not None
    assert ready.wait(60)
    child = int(open(os.path.join(root, "child.pid")).read())
    try:
        with pytest.raises(lock.RootLocked, match="in use by another writer"):
            lock.acquire(root)  # a live holder: refused at once
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while _state(p.pid) != "Z":  # killed, not reaped yet: a zombie holds no files
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monkeypatch.setattr(lock, "ORPHAN_WAIT_S", 0.2)
        with pytest.raises(lock.RootLocked, match=rf"no longer running: pid {p.pid} .*fuser -v"):
            lock.acquire(root)  # the child never let go: never taken, the dead holder named
        p.join()
        monkeypatch.setattr(lock, "ORPHAN_WAIT_S", 600.0)
        cued: list[str] = []

        class _Cue(logging.Handler):  # the child lets go while the successor waits
            def emit(self, record: logging.LogRecord) -> None:
                cued.append(record.getMessage())
                os.write(cue_w, b"x")

        cue = _Cue()
        logging.getLogger("unbroken.ckpt.lock").addHandler(cue)
        try:
            with caplog.at_level(logging.INFO, logger="unbroken.ckpt.lock"):
                lease = lock.acquire(root)
        finally:
            logging.getLogger("unbroken.ckpt.lock").removeHandler(cue)
        lease.release()
        assert len(cued) == 1 and f"holder (pid {p.pid}) is gone" in cued[0]
    finally:
        os.kill(child, signal.SIGKILL)
        os.close(cue_r)
        os.close(cue_w)


def test_a_lease_released_by_a_collection_inside_the_guard_does_not_deadlock(tmp_path):
    """A Checkpointer dropped without close() releases its lease from a weakref finalizer,
    which a garbage collection can run on a thread that is inside the lock module's guard
    (any allocation in ``acquire`` may collect): the release must be deferred to the end of
    that section, not wait on the guard this very thread holds (seen in CI: a unit test
    hung 300 s until pytest-timeout's exception broke the wait)."""
    code = textwrap.dedent(
        """
        import os, sys
        from unbroken.ckpt import lock
        a, b = sys.argv[1], sys.argv[2]
        lease = lock.acquire(a)
        with lock._guarded():  # as a collection inside acquire(b) would
            lease.release()
            assert os.path.exists(os.path.join(a, ".lock"))  # deferred, still held
        assert not os.path.exists(os.path.join(a, ".lock"))  # released on leaving
        lock.acquire(b).release()
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "a"), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
