"""Adopting unbroken costs a stock DDP loop at most 30 changed lines: the diff between
``examples/ddp_stock.py`` and ``examples/ddp_unbroken.py`` (both run in tests/drill), not
counting the module docstrings (they say how to run each file)."""

from __future__ import annotations

import ast
import difflib
import os

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _code(name: str) -> list[str]:
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        src = f.read()
    doc = ast.parse(src).body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    return src.splitlines()[doc.end_lineno :]


def changed_lines(old: list[str], new: list[str]) -> tuple[int, int, int]:
    """(changed, added, removed): a replaced line counts once in ``changed``."""
    changed = added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
        None, old, new, autojunk=False
    ).get_opcodes():
        if tag != "equal":
            changed += max(i2 - i1, j2 - j1)
            added += j2 - j1
            removed += i2 - i1
    return changed, added, removed


def test_a_stock_ddp_loop_adopts_unbroken_in_at_most_30_changed_lines():
    changed, added, removed = changed_lines(_code("ddp_stock.py"), _code("ddp_unbroken.py"))
    print(f"ddp_stock.py -> ddp_unbroken.py: {changed} changed lines (+{added} -{removed})")
    assert changed <= 30 and added <= 30, (changed, added, removed)
    assert changed >= 10  # the files really differ (the test cannot pass on two copies)


def test_the_count_counts():
    assert changed_lines(["a", "b", "c"], ["a", "B", "c", "d"]) == (2, 2, 1)
    assert changed_lines(["a"], ["a"]) == (0, 0, 0)


def test_a_nanogpt_style_script_adopts_unbroken_in_at_most_20_changed_lines():
    """issue 21: ``examples/gpt_flat/train_stock.py`` (flat ``train.bin``, random
    ``get_batch``, the next batch held across the backward pass, ``iter_num`` and
    ``best_val_loss`` as globals, DDP) -> ``train.py``: resumable, supervised, drillable."""
    old, new = _code("gpt_flat/train_stock.py"), _code("gpt_flat/train.py")
    changed, added, removed = changed_lines(old, new)
    print(f"gpt_flat/train_stock.py -> train.py: {changed} changed lines (+{added} -{removed})")
    assert changed <= 20 and added <= 20, (changed, added, removed)
    assert changed >= 10  # the files really differ
    assert any("held_batches=1" in line for line in new)  # the held batch is kept, declared
    assert sum("get_batch(" in line for line in new) >= 3  # the training loop's calls stay
