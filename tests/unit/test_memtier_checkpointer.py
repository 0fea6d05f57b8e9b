"""The memory tier inside the Checkpointer (issue 25 items 1 and 3: publish every K steps,
restore the newest verified tier with one line naming it; C-TIERS).

In-process: a Checkpointer trains with ``memory_every_steps=1, every_steps=5``; "crash" is
dropping it without ``close()`` (its locks released as the kernel would); a fresh state
restores. The SIGKILL of a real process is tests/integration/test_memtier_resume.py.
"""

from __future__ import annotations

import logging
import os
from typing import cast

import pytest

from ckptkit import can_mount, flip, identical, small_state, snapshot, tmpfs, train
from unbroken.ckpt import Checkpointer, TrainState
from unbroken.ckpt.memtier import MemoryTier, SlotStore


def _ckpt(root: str, tier: str, seed: int = 0, **kw):
    st, m, opt = small_state(seed)
    ck = Checkpointer(
        root, st, every_steps=5, memory_every_steps=1, memory_dir=tier, keep_last=2, **kw
    )
    return st, m, opt, ck


def _run(root: str, tier: str, steps: int, **kw):
    st, m, opt, ck = _ckpt(root, tier, **kw)
    assert ck.restore() is None
    for _ in range(steps):
        train(st, m, opt, 1)
        ck.maybe_save()
    ck.wait()
    return st, m, opt, ck


def _crash(ck: Checkpointer) -> None:
    """What the kernel does for a SIGKILLed process: its locks go, nothing else."""
    assert ck._memory is not None
    ck._memory.store.close()
    ck._lock.release()
    if ck._pool is not None:
        ck._pool.shutdown(wait=True)
        ck._pool = None


def _disk_step_after_memory(root: str, tier: str, steps: int) -> Checkpointer:
    """Train ``steps`` steps with both tiers, then one more step saved to disk only (a
    multiple of 5), then crash: the memory tier is older than the disk tier. The crashed
    checkpointer is returned: dropped, its finalizer would tidy the slots up."""
    st, m, opt, ck = _run(root, tier, steps)
    assert ck._memory is not None
    ck._memory.disabled = "test: stop publishing"
    train(st, m, opt, 1)
    ck.maybe_save()  # the disk tier only
    ck.wait()
    _crash(ck)
    return ck


def _restored_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "resumed from step" in r.getMessage()]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_resumes_from_memory_losing_no_step(tmp_path, caplog, mode) -> None:
    """issue 25: K=1, N=5, crash after step 7: memory holds step 7 (disk: 5); the restore
    takes it, says so in one line, and the state is bit-identical to the one saved. Every
    publish copies the live tensors into the slot in the loop and leaves the checksum and
    header to the tier's thread (issue 25 speed item 3: no inline/background split)."""
    async_save = mode != "sync"
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    st, _, _, ck = _run(root, tier, 7, async_save=async_save)
    want = snapshot(st)
    _crash(ck)
    st2, _, _, ck2 = _ckpt(root, tier, seed=1, async_save=async_save)
    caplog.clear()  # only this restore's lines (an earlier one may have logged)
    with caplog.at_level(logging.INFO, logger="unbroken.ckpt.checkpointer"):
        assert ck2.restore() == 7
    assert ck2.restored_tier == "memory"
    assert identical(snapshot(st2), want)
    lines = _restored_lines(caplog)
    assert (
        len(lines) == 1
        and lines[0].startswith("resumed from step 7,")
        and "from the memory tier" in lines[0]
    ), lines
    ck2.close()


def test_resumed_run_continues_bit_identical(tmp_path) -> None:
    """Crash at 7, resume from memory, train to 12: equal to 12 straight steps."""
    ref_st, _, _, ref_ck = _run(str(tmp_path / "ref"), str(tmp_path / "unbroken-r" / "job"), 12)
    ref_ck.close()
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    *_, ck = _run(root, tier, 7)
    _crash(ck)
    st, m, opt, ck2 = _ckpt(root, tier, seed=1)
    assert ck2.restore() == 7
    for _ in range(5):
        train(st, m, opt, 1)
        ck2.maybe_save()
    ck2.close()
    assert identical(snapshot(st), snapshot(ref_st))


def test_damaged_slots_fall_back_to_the_older_slot_then_disk(tmp_path, caplog) -> None:
    """issue 25: a damaged slot: the older slot (step 6); both damaged: disk step 5, and
    the one line says why the newer memory tier was skipped."""
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    *_, ck = _run(root, tier, 7)
    _crash(ck)
    slots = SlotStore(tier, rank=0)
    snap, _ = slots.newest()
    assert snap is not None and snap.step == 7
    newest = snap.path
    older = next(p for p in (slots.slot_path(0), slots.slot_path(1)) if p != newest)
    del snap
    flip(newest, os.path.getsize(newest) - 11)
    *_, ck2 = _ckpt(root, tier, seed=1)
    assert ck2.restore() == 6 and ck2.restored_tier == "memory"
    _crash(ck2)
    flip(older, os.path.getsize(older) - 11)
    *_, ck3 = _ckpt(root, tier, seed=1)
    caplog.clear()  # only this restore's lines (an earlier one may have logged)
    with caplog.at_level(logging.INFO, logger="unbroken.ckpt.checkpointer"):
        assert ck3.restore() == 5
    assert ck3.restored_tier == "disk"
    lines = _restored_lines(caplog)
    assert len(lines) == 1, lines
    assert (
        lines[0].startswith("resumed from step 5,")
        and "from the disk tier" in lines[0]
        and "memory tier not used" in lines[0]
    )
    assert "checksum" in lines[0]
    ck3.close()


def test_memory_older_than_disk_is_skipped(tmp_path, caplog) -> None:
    """A slot of an older step than the disk's newest is not used, and the line says so."""
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    crashed = _disk_step_after_memory(root, tier, 4)  # memory 3 and 4, disk 5
    *_, ck2 = _ckpt(root, tier, seed=1)
    caplog.clear()  # only this restore's lines (an earlier one may have logged)
    with caplog.at_level(logging.INFO, logger="unbroken.ckpt.checkpointer"):
        assert ck2.restore() == 5
    line = _restored_lines(caplog)[0]
    assert "disk tier" in line and "memory step 4 is older than disk step 5" in line
    ck2.close()
    del crashed


def test_slots_of_another_root_are_never_used(tmp_path) -> None:
    """One memory directory, two roots: a slot records its root and is used only for it."""
    tier = str(tmp_path / "unbroken-x" / "job")
    *_, ck = _run(str(tmp_path / "a"), tier, 3)
    _crash(ck)
    *_, ck2 = _ckpt(str(tmp_path / "b"), tier, seed=1)
    assert ck2.restore() is None
    ck2.close()


def test_clean_close_removes_slots_only_when_disk_holds_as_much(tmp_path) -> None:
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    *_, ck = _run(root, tier, 7)  # memory 7, disk 5: kept
    ck.close()
    assert os.path.exists(os.path.join(tier, "rank-0", "slot-0"))
    other = str(tmp_path / "unbroken-y" / "job")
    *_, ck2 = _run(str(tmp_path / "ckpt2"), other, 5)
    ck2.close()  # memory 5 == disk 5: removed, directory too
    assert not os.path.exists(other)


def test_config_refuses_bad_memory_options(tmp_path) -> None:
    st, _, _ = small_state()
    with pytest.raises(ValueError, match="memory_every_steps=0 must be an integer >= 1"):
        Checkpointer(str(tmp_path), st, memory_every_steps=0)
    with pytest.raises(ValueError, match="memory_dir=''"):
        Checkpointer(str(tmp_path), st, memory_every_steps=1, memory_dir="")


@pytest.mark.skipif(not can_mount(), reason="needs root and mount(8) for a tiny tmpfs")
def test_full_tmpfs_turns_the_tier_off_and_training_goes_on(tmp_path, caplog) -> None:
    """A publish that finds the tmpfs full (ENOSPC) turns the memory tier off with one
    WARNING; training and the disk tier go on, and restore uses disk."""
    import torch

    root = str(tmp_path / "ckpt")
    with tmpfs(str(tmp_path / "shm"), "1m") as shm:
        torch.manual_seed(0)
        m = torch.nn.Linear(512, 512)  # 1 MiB of weights + 2 MiB of AdamW moments
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        st = TrainState(model=m, optimizer=opt)
        ck = Checkpointer(root, st, every_steps=2, memory_every_steps=1, memory_dir=f"{shm}/job")
        with caplog.at_level(logging.WARNING, logger="unbroken.ckpt.checkpointer"):
            for _ in range(4):
                m(torch.ones(2, 512)).sum().backward()
                opt.step()
                opt.zero_grad()
                st.step += 1
                ck.maybe_save()
        warned = [r.getMessage() for r in caplog.records if "memory tier off" in r.getMessage()]
        assert len(warned) == 1 and "No space left" in warned[0], warned
        assert ck.latest() == 4
        ck._lock.release()
        cast(MemoryTier, ck._memory).store.close()
        ck2 = Checkpointer(root, st, memory_every_steps=1, memory_dir=f"{shm}/job")
        assert ck2.restore() == 4 and ck2.restored_tier == "disk"
        ck2.close()


def test_a_live_publisher_keeps_a_restore_off_its_slots(tmp_path) -> None:
    """Restore takes the rank directory's lock: a worker still alive (not yet stopped)
    could rewrite a slot while it is read; memory is skipped, disk used, and said why."""
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    *_, ck = _run(root, tier, 7)  # still holds the lock: alive
    ck._lock.release()
    *_, ck2 = _ckpt(root, tier, seed=1)
    assert ck2.restore() == 5 and ck2.restored_tier == "disk"
    ck2.close()
    ck.close()


def _newest_and_older(tier: str) -> tuple[str, str]:
    slots = SlotStore(tier, rank=0)
    snap, _ = slots.newest()
    assert snap is not None
    newest = snap.path
    del snap
    return newest, next(p for p in (slots.slot_path(0), slots.slot_path(1)) if p != newest)


@pytest.mark.parametrize(
    "case, want_step, want_tier, says",
    [
        # the newest slot's payload damaged: the older slot, and the line says why
        ("payload", 6, "memory", ["memory step 7 is damaged", "checksum", "disk's newest: step 5"]),
        # the newest slot's header damaged: its step is unknown, the line still names it
        ("header", 6, "memory", ["slot-", "is damaged (bad-header"]),
        # both slots gone (a node replaced, a tier never written): disk, "missing"
        ("gone", 5, "disk", ["memory tier not used", "missing"]),
        # both damaged: disk, each slot named damaged
        ("both", 5, "disk", ["memory tier not used", "is damaged", "checksum"]),
    ],
)
def test_one_line_names_tier_step_and_why_a_newer_tier_was_skipped(
    tmp_path, caplog, case, want_step, want_tier, says
) -> None:
    """issue 25 item 2: one choice, made visibly: every restore prints ONE line naming the
    tier, the step, and why a newer tier was skipped (missing, older, damaged)."""
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    *_, ck = _run(root, tier, 7)  # memory: steps 6 and 7, disk: step 5
    _crash(ck)
    newest, older = _newest_and_older(tier)
    if case == "payload":
        flip(newest, os.path.getsize(newest) - 11)
    elif case == "header":
        flip(newest, 40)  # inside the fixed header fields
    elif case == "gone":
        os.unlink(newest)
        os.unlink(older)
    else:
        flip(newest, os.path.getsize(newest) - 11)
        flip(older, os.path.getsize(older) - 11)
    *_, ck2 = _ckpt(root, tier, seed=1)
    caplog.clear()  # only this restore's lines (an earlier one may have logged)
    with caplog.at_level(logging.INFO, logger="unbroken.ckpt.checkpointer"):
        assert ck2.restore() == want_step
    assert ck2.restored_tier == want_tier
    lines = _restored_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"resumed from step {want_step},"), lines
    assert f"from the {want_tier} tier" in lines[0], lines
    for s in says:
        assert s in lines[0], (s, lines[0])
    ck2.close()


def test_disk_steps_skipped_for_damage_are_named_in_the_line(tmp_path, caplog) -> None:
    """issue 25 item 2: the memory tier older than disk and the newest disk step damaged:
    the older disk step is restored and the one line names both skips (memory older, disk
    step damaged)."""
    from ckptkit import data_files, step_dir

    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    crashed = _disk_step_after_memory(root, tier, 9)  # disk 5 and 10, memory 8 and 9
    victim = os.path.join(step_dir(root, 10), data_files(step_dir(root, 10))[0])
    flip(victim, os.path.getsize(victim) // 2)
    *_, ck2 = _ckpt(root, tier, seed=1)
    caplog.clear()  # only this restore's lines (an earlier one may have logged)
    with caplog.at_level(logging.INFO, logger="unbroken.ckpt.checkpointer"):
        assert ck2.restore() == 9
    (line,) = _restored_lines(caplog)
    assert "from the memory tier" in line and "disk step 10 is damaged" in line, line
    ck2.close()
    del crashed


def test_disk_saves_record_the_memory_tiers_cost_for_the_planner(tmp_path, monkeypatch) -> None:
    """issue 25 item 4: under `unbroken run` each disk save's `saved` event carries the
    memory tier's mean publish stall since the last save, K and the bytes its slots hold
    (what `unbroken plan` reads)."""
    from unbroken.common import events

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv(events.ENV_RUN_DIR, str(run))
    monkeypatch.setenv(events.ENV_ATTEMPT, "0")
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    *_, ck = _run(root, tier, 7)
    ck.close()
    (saved,) = events.load_events(str(run))
    assert saved["event"] == "saved" and saved["step"] == 5
    assert 0 < saved["memory_seconds"] < 5 and saved["memory_every"] == 1
    assert saved["memory_bytes"] > 0


@pytest.mark.parametrize("big", [True, False], ids=["background", "small-inline"])
def test_the_loop_copies_and_the_tier_thread_completes_every_step(
    tmp_path, monkeypatch, big
) -> None:
    """issue 25 speed item 3: at K=1 the loop pays for the copy into the slot only; the
    checksum and header (what makes the slot complete) are written by the tier's thread
    (``big``: the size threshold lowered to 0; a slot below it is hashed in the loop,
    cheaper than the hand-off). A publish that comes while the previous one is still being
    completed waits for it: no step is ever skipped (K=1 promises at most one step lost)."""
    import threading

    from unbroken.ckpt import memtier

    if big:
        monkeypatch.setattr(memtier, "BACKGROUND_BYTES", 0)
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    st, m, opt, ck = _ckpt(root, tier)
    memory = ck._memory
    assert memory is not None
    seen: list[tuple[int, str]] = []
    memory.store.on_complete = lambda _p, step, _g: seen.append(
        (step, threading.current_thread().name)
    )
    for _ in range(12):
        train(st, m, opt, 1)
        ck.maybe_save()
    ck.wait()
    memory_steps = [s for s in range(1, 13) if s % 5]  # disk saves publish synchronously
    assert [s for s, _ in seen] == list(range(1, 13)), seen
    where = "unbroken-memtier" if big else threading.current_thread().name
    assert all(name.startswith(where) for s, name in seen if s in memory_steps), seen
    ck.close()


def test_a_fresh_start_past_an_unusable_memory_step_is_a_warning_naming_it(
    tmp_path, caplog
) -> None:
    """issue 25 (C-TIERS, found in CI: a node lost mid-transfer of its replica left no
    step every rank held, and the job started from scratch with no line saying why): when
    the memory tier holds a step that cannot be used and no disk step exists, the fresh
    start is one WARNING naming the memory tier's reason."""
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    _, _, _, ck = _run(root, tier, 3)  # memory steps 2 and 3, no disk step (every 5)
    _crash(ck)
    slots = SlotStore(tier, rank=0)
    for i in range(2):
        flip(slots.slot_path(i), os.path.getsize(slots.slot_path(i)) - 11)
    *_, ck2 = _ckpt(root, tier, seed=1)
    caplog.clear()  # only this restore's lines (an earlier one may have logged)
    with caplog.at_level(logging.INFO, logger="unbroken.ckpt.checkpointer"):
        assert ck2.restore() is None
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "from scratch" in r.getMessage()
    ]
    assert len(warned) == 1, [(r.name, r.getMessage()[:60]) for r in caplog.records]
    assert "memory tier not used" in warned[0] and "checksum" in warned[0], warned[0]
    ck2.close()


def test_the_other_slot_is_mapped_and_faulted_in_off_the_loop(tmp_path, monkeypatch) -> None:
    """issue 25 item 2 (the 2 GiB stall): once the first background publish is complete,
    the tier's thread maps the other slot with its layout and faults its pages in (a 2 GiB
    slot's first copy took 1.4 s against 0.5 s later); the next publish copies into that
    mapping; the slot holding the newest complete step is never the one prepared."""
    from unbroken.ckpt import memtier

    monkeypatch.setattr(memtier, "BACKGROUND_BYTES", 0)
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    st, m, opt, ck = _ckpt(root, tier)
    memory = ck._memory
    assert memory is not None
    store = memory.store
    train(st, m, opt, 1)
    ck.maybe_save()
    memory.wait()
    assert set(store._maps) == {0, 1}
    prepared = store._maps[1]
    assert os.path.getsize(store.slot_path(1)) == os.path.getsize(store.slot_path(0))
    snap, _ = store.newest()
    assert snap is not None and snap.step == 1 and snap.path == store.slot_path(0)
    del snap
    train(st, m, opt, 1)
    ck.maybe_save()
    memory.wait()
    assert store._maps[1] is prepared
    snap, _ = store.newest()
    assert snap is not None and snap.step == 2 and snap.path == store.slot_path(1)
    del snap
    ck.close()


_DIES = """
import sys
sys.path.insert(0, {tests!r})
from ckptkit import small_state, train
from unbroken.ckpt import Checkpointer
st, m, opt = small_state(0)
ck = Checkpointer({root!r}, st, every_steps=5, memory_every_steps=1, memory_dir={tier!r})
ck.restore()
for _ in range(5):
    train(st, m, opt, 1)
    ck.maybe_save()
ck.wait()
{end}
"""

_ENDS = {
    # unhandled: the at-exit flush runs
    "exception": ('raise RuntimeError("a peer\'s collective failed")', 1),
    "clean": ("", 0),
    # the loop catches it and exits 1: the interpreter records no exception
    "caught, exit 1": (
        'try:\n    raise RuntimeError("a peer\'s collective failed")\n'
        "except RuntimeError as e:\n    print(e, file=sys.stderr)\n    sys.exit(1)",
        1,
    ),
}


@pytest.mark.parametrize(
    "end, agent, kept",
    [
        ("exception", False, True),
        ("clean", False, False),
        ("caught, exit 1", True, True),
    ],
)
def test_slots_are_kept_unless_the_process_that_owns_them_ends_cleanly(
    tmp_path, end, agent, kept
) -> None:
    """Memory step 5 == disk step 5. A clean end removes the slots (the disk tier holds as
    much); an end by an unhandled exception is a crash, whose restart needs them (a survivor
    of a lost peer keeps its own slots and the replica it holds for the lost rank): the
    at-exit flush keeps them, as a SIGKILL would. Under ``unbroken run`` (``agent``) the
    node's agent owns the directory and removes it when the job ends, so a worker keeps its
    slots however it ends, a loop that catches the failure and exits 1 among them (the
    interpreter records no exception then, so a worker could not tell it from a clean end)."""
    import subprocess
    import sys

    from unbroken.common import memdir

    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code, rc = _ENDS[end]
    env = {k: v for k, v in os.environ.items() if k not in (memdir.ENV, memdir.AGENT_ENV)}
    if agent:
        env |= {memdir.ENV: tier, memdir.AGENT_ENV: tier}
    src = _DIES.format(tests=tests, root=root, tier=tier, end=code)
    proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, env=env)
    assert proc.returncode == rc, proc.stderr
    assert ("a peer's collective failed" in proc.stderr) == (end != "clean")
    slots = [os.path.join(tier, "rank-0", f"slot-{i}") for i in range(2)]
    assert all(os.path.exists(s) for s in slots) == kept, os.listdir(tmp_path)
    if kept:
        st, _, _, ck = _ckpt(root, tier, seed=1)
        assert ck.restore() == 5 and ck.restored_tier == "memory"
        ck.close()


def test_a_rollback_leaves_no_memory_step_of_the_abandoned_run_to_resume(tmp_path) -> None:
    """``restore(5)`` on purpose (a loss spike) after steps 7 and 8 were published to the
    memory tier: the run goes on from 5. The disk steps newer than 5 were moved aside at the
    first save, but the memory slots of 7 and 8 stayed, and a crash then resumed the
    abandoned run's step 8 (or, after one new publish, still 8, not the new 6)."""
    root, tier = str(tmp_path / "ckpt"), str(tmp_path / "unbroken-x" / "job")
    *_, ck = _run(root, tier, 8)
    _crash(ck)
    st, m, opt, ck2 = _ckpt(root, tier, seed=1)
    assert ck2.restore(5) == 5
    train(st, m, opt, 1)
    ck2.maybe_save()  # step 6 of the new trajectory, to memory
    ck2.wait()
    want = snapshot(st)
    _crash(ck2)
    st3, _, _, ck3 = _ckpt(root, tier, seed=2)
    assert ck3.restore() == 6
    assert identical(snapshot(st3), want)
    ck3.close()
