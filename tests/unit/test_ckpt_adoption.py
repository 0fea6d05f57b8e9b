"""A training script adopts the checkpointer without traps (issue 21 items 3, 4, 5): a counter
that does not advance is said once, a final ``save()`` of the step just saved is a no-op,
plain values live in the state, every restore and fall-back prints one line, and a restore
the live state refuses raises its own exception class."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from ckptkit import edit_state, small_state, step_dir, train
from unbroken.ckpt import Checkpointer, RestoreRefused, TrainState
from unbroken.ckpt.store import CorruptCheckpoint
from unbroken.cli import main


@pytest.mark.parametrize("advance", [False, True])
def test_maybe_save_warns_once_when_the_step_does_not_advance(tmp_path, advance: bool) -> None:
    """issue 21 item 3: the script forgot ``state.step = iter_num``: one warning, naming
    ``state.step`` and ``maybe_save(step)``, however long the loop runs; a loop that
    advances its step hears nothing."""
    st, m, opt = small_state()
    ck = Checkpointer(str(tmp_path / "ck"), st, every_steps=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(30):
            train(st, m, opt, 1)
            if not advance:
                st.step = 0  # what a script that never sets state.step looks like
            ck.maybe_save(st.step)
    said = [str(w.message) for w in record if "does not advance" in str(w.message)]
    ck.close()
    if advance:
        assert not said, said
        return
    assert len(said) == 1, said
    assert "state.step" in said[0] and "maybe_save(step)" in said[0], said[0]
    assert [i.step for i in ck.list()] == [0]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_final_save_of_the_step_just_saved_is_a_no_op(tmp_path, async_save: bool) -> None:
    """issue 21 item 3: ``maybe_save`` saved the last step; the script's final ``save()`` of
    the same, unchanged state returns the committed directory and writes nothing."""
    st, m, opt = small_state()
    ck = Checkpointer(str(tmp_path / "ck"), st, every_steps=2, async_save=async_save)
    for _ in range(4):
        train(st, m, opt, 1)
        ck.maybe_save()
    ck.wait()
    d = step_dir(str(tmp_path / "ck"), 4)
    before = os.stat(os.path.join(d, "manifest.json"))
    assert ck.save() == d
    assert ck.wait() in (None, d)
    after = os.stat(os.path.join(d, "manifest.json"))
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert [i.step for i in ck.list()] == [2, 4]
    ck.close()


def test_a_changed_state_at_a_committed_step_still_refuses_clearly(tmp_path) -> None:
    """issue 21 item 3: other content under a committed step number is refused, with the
    first difference and the fix (advance ``state.step``); an older step is immutable."""
    st, m, opt = small_state()
    ck = Checkpointer(str(tmp_path / "ck"), st)
    train(st, m, opt, 2)
    ck.save()
    train(st, m, opt, 1)
    st.step = 2  # trained on, step not advanced
    with pytest.raises(FileExistsError) as e:
        ck.save()
    text = str(e.value)
    assert "step 2" in text and "differs" in text and "state.step" in text, text
    assert "components/model" in text, text  # the first difference, named
    train(st, m, opt, 1)
    ck.save()  # step 4
    with pytest.raises(FileExistsError, match="immutable"):
        ck.save(2)
    ck.close()


def test_latest_is_documented_in_the_readme() -> None:
    """issue 21 item 3: ``latest()`` and ``maybe_save(step)`` are in the README, not only in
    docstrings."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    assert "ckpt.latest()" in readme and "maybe_save(step)" in readme


# --- plain values (issue 21 item 4) -----------------------------------------------------------


def test_plain_values_are_saved_restored_and_shared_by_every_rank(tmp_path) -> None:
    """issue 21 item 4: ``TrainState(values={...})``: JSON scalars the loop reads and
    writes, saved with the checkpoint, restored, declared the same on every rank."""
    root = str(tmp_path / "ck")
    st, m, opt = small_state(values={"best_val_loss": 1e9, "iter_num": 0})
    assert st.sharing["values"] == "replicated"
    train(st, m, opt, 2)
    st.values["best_val_loss"] = 2.5
    st.values["iter_num"] = 2
    st.values["note"] = "warm-up done"  # a value added by the loop
    st.values["worst"] = -math.inf
    ck = Checkpointer(root, st)
    ck.save()
    ck.close()
    st2, _, _ = small_state(1, values={"best_val_loss": 1e9, "iter_num": 0, "added_later": True})
    ck2 = Checkpointer(root, st2)
    assert ck2.restore() == 2
    ck2.close()
    assert dict(st2.values) == {
        "best_val_loss": 2.5,
        "iter_num": 2,
        "note": "warm-up done",
        "worst": -math.inf,
        "added_later": True,  # a value the checkpoint predates keeps its default
    }


@pytest.mark.parametrize(
    "bad",
    [torch.tensor(1.0), [1, 2], {"a": 1}, object(), 1 << 70, "x" * 70_000],
    ids=["tensor", "list", "dict", "object", "huge-int", "long-str"],
)
def test_a_value_that_is_not_a_plain_scalar_is_refused_where_it_is_set(bad: object) -> None:
    """issue 21 item 4: the loop learns at once, naming the key and the fix."""
    st = TrainState(values={"ok": 1})
    with pytest.raises((TypeError, ValueError), match=r"values\['v'\]"):
        st.values["v"] = bad
    with pytest.raises((TypeError, ValueError), match=r"values\['v'\]"):
        TrainState(values={"v": bad})


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda v: v.update(best_val_loss={"nested": 1}), "best_val_loss"),
        (lambda v: v.update(best_val_loss="y" * 100_000), "best_val_loss"),
        (lambda v: v.update({f"k{i}": i for i in range(20_000)}), "values"),
        (lambda v: v.update({"k" * 5000: 1}), "values"),
        (lambda v: v.update(best_val_loss=[1.0]), "best_val_loss"),
    ],
    ids=["nested", "long-str", "many-keys", "long-key", "list"],
)
def test_hostile_values_are_damage_to_restore_and_to_verify(tmp_path, edit, named, capsys) -> None:
    """issue 21 item 4: the values file is untrusted: bounded, types checked, offline (``ckpt
    verify``) and at restore alike; restore falls back to the older checkpoint."""
    root = str(tmp_path / "ck")
    st, m, opt = small_state(values={"best_val_loss": 1e9})
    ck = Checkpointer(root, st, allow_fresh_start=True)
    for want in (3.0, 2.0):
        train(st, m, opt, 1)
        st.values["best_val_loss"] = want
        ck.save()
    ck.close()
    edit_state(step_dir(root, 2), lambda b: edit(b["state"]["components"]["values"]))
    assert main(["ckpt", "verify", root, "--step", "2"]) != 0
    assert named in capsys.readouterr().out
    st2, _, _ = small_state(1, values={"best_val_loss": 1e9})
    ck2 = Checkpointer(root, st2, quiet=True)
    assert ck2.restore() == 1
    ck2.close()
    assert st2.values["best_val_loss"] == 3.0


# --- one line on stderr (issue 21 item 5) ------------------------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from unbroken.ckpt import Checkpointer, TrainState
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    st = TrainState(model=m, values={"best_val_loss": 1e9})
    ck = Checkpointer(sys.argv[1], st, quiet=sys.argv[2] == "quiet")
    start = ck.restore()
    print("restored", start)
    if start is None:
        for s in (1, 2):
            st.step = s
            ck.save()
    ck.close()
    """
)


def _run(tmp_path, root: str, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    return subprocess.run(
        [sys.executable, str(script), root, "quiet" if quiet else "loud"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )


@pytest.mark.slow  # issue 24 item 10: out of `make unit`, still in `make test`
def test_every_restore_and_fall_back_prints_one_line_without_logging_configured(
    tmp_path,
) -> None:
    """issue 21 item 5: a script that configures no logging hears, from rank 0 on stderr,
    which step it resumed from (when saved, how long it took) and which step was skipped
    and why (escaped); ``quiet=True`` is silent."""
    root = str(tmp_path / "ck")
    first = _run(tmp_path, root)
    assert "restored None" in first.stdout
    assert "resumed" not in first.stderr, first.stderr
    # damage the newest: a reason that quotes the file, with a terminal escape in it
    edit_state(step_dir(root, 2), lambda b: b["state"]["components"]["values"].update(
        {"\x1b[31mbest": [1]}
    ))  # fmt: skip
    second = _run(tmp_path, root)
    assert "restored 1" in second.stdout
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("unbroken: ")]
    assert len(lines) == 2, second.stderr
    skipped, resumed = lines
    assert "step 2" in skipped and "bad-state" in skipped, skipped
    assert "\x1b" not in second.stderr and "\\x1b[31m" in skipped, skipped
    assert resumed.startswith("unbroken: resumed from step 1, saved at "), resumed
    # C-TIERS (issue 25 item 2): the line also says why the newer step was skipped, by
    # its kind; the WARNING line above it has the detail
    tail = r" UTC, in [\d.]+ s, from the disk tier; disk step 2 is damaged \(bad-state\)$"
    assert re.search(tail, resumed), resumed
    third = _run(tmp_path, root, quiet=True)
    assert "restored 1" in third.stdout
    assert "unbroken:" not in third.stderr, third.stderr


# --- refusals are their own class (issue 21, the supervisor's configuration fault) --------------


def test_a_shape_mismatch_raises_restore_refused_and_marks_the_event(tmp_path, monkeypatch) -> None:
    """issue 21 (supervisor: a deterministic refusal at restore is a configuration fault):
    ``RestoreRefused`` (a ``ValueError``) and a ``restore_refused`` event for ``unbroken run``."""
    root = str(tmp_path / "ck")
    st, m, opt = small_state()
    ck = Checkpointer(root, st)
    train(st, m, opt, 1)
    ck.save()
    ck.close()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("UNBROKEN_RUN_DIR", str(run_dir))
    wide = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    wopt = torch.optim.AdamW(wide.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(wopt, 3)
    other = TrainState(model=wide, optimizer=wopt, scheduler=sched)
    ck2 = Checkpointer(root, other)
    with pytest.raises(RestoreRefused) as e:
        ck2.restore()
    ck2.close()
    assert isinstance(e.value, ValueError) and not isinstance(e.value, CorruptCheckpoint)
    events = [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines()]
    refused = [ev for ev in events if ev["event"] == "restore_refused"]
    assert len(refused) == 1, events
    assert refused[0]["step"] == 1 and "does not" in refused[0]["reason"], refused[0]


def test_capture_rng_false_leaves_the_rng_alone_and_says_no_resize(tmp_path, caplog) -> None:
    """Found while profiling restore for issue 23: a state saved and restored with
    ``capture_rng=False`` had its RNG re-seeded from (seed, rank, step) and a WARNING
    "world size changed (1 -> 1 ranks)" at the same world size."""
    import logging
    import random

    root = str(tmp_path / "ck")
    m = torch.nn.Linear(4, 4)
    st = TrainState(model=m, capture_rng=False)
    st.step = 3
    Checkpointer(root, st).save()
    ck = Checkpointer(root, TrainState(model=torch.nn.Linear(4, 4), capture_rng=False))
    random.seed(1234)
    torch.manual_seed(1234)
    want = (random.getstate(), torch.get_rng_state())
    with caplog.at_level(logging.INFO, logger="unbroken"):
        assert ck.restore() == 3
    ck.close()
    assert random.getstate() == want[0] and torch.equal(torch.get_rng_state(), want[1])
    assert not [r for r in caplog.records if "world size changed" in r.getMessage()]


def test_keywords_that_are_not_components_are_plain_values() -> None:
    """issue 21 item 4, the one-line form: ``TrainState(model=m, best_val_loss=1e9)`` is
    ``values={"best_val_loss": 1e9}``; a keyword holding an object is a misspelt component
    and is refused by name, as is a value given twice."""
    st, m, opt = small_state()
    kw = TrainState(model=m, optimizer=opt, best_val_loss=1e9, run="a")
    assert dict(kw.values) == {"best_val_loss": 1e9, "run": "a"}
    assert "values" in kw.components
    both = TrainState(model=m, values={"a": 1}, b=2)
    assert dict(both.values) == {"a": 1, "b": 2}
    with pytest.raises(TypeError, match="optimiser=AdamW.*misspelling"):
        TrainState(model=m, optimiser=opt)
    with pytest.raises(TypeError, match="'a' both in values= and as a keyword"):
        TrainState(model=m, values={"a": 1}, a=2)


@pytest.mark.parametrize("async_save", [False, True])
def test_maybe_save_final_saves_the_last_step_whatever_the_interval(
    tmp_path, async_save: bool
) -> None:
    """issue 21 item 3: the loop's last step is saved by the same call the loop makes every
    step (``maybe_save(step, final=...)``), committed when it returns, and a repeat is a
    no-op."""
    st, m, opt = small_state()
    ck = Checkpointer(str(tmp_path / "ck"), st, every_steps=4, async_save=async_save)
    for i in range(1, 8):
        train(st, m, opt, 1)
        ck.maybe_save(i, final=i == 7)
    assert [c.step for c in ck.list()] == [4, 7]
    assert ck.maybe_save(7, final=True)  # the same step again: no-op, no error
    ck.close()


def test_a_root_unbroken_creates_is_private(tmp_path) -> None:
    """The README's security model (issue 21 report; RULES: private modes on a shared node):
    the root and each step directory unbroken creates are 0700; a root that exists keeps
    the mode its owner gave it."""
    root = tmp_path / "new" / "ck"
    st = TrainState(model=torch.nn.Linear(2, 2))
    st.step = 1
    Checkpointer(str(root), st).save()
    assert os.stat(root).st_mode & 0o777 == 0o700
    assert os.stat(step_dir(str(root), 1)).st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    os.chmod(shared, 0o750)
    Checkpointer(str(shared), st).save()
    assert os.stat(shared).st_mode & 0o777 == 0o750
