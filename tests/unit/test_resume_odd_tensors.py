"""Tensors with a lazy view bit or overlapping memory survive a save and a restore with
their values (C-IDENTICAL, all or nothing).

* A conjugate view (``z.conj()``: a bit on the tensor, its memory unconjugated) was written
  by a blocking save as its memory, so it came back conjugated: a silently wrong value
  (an async save copies it into a buffer first, which resolves the bit).
* An expanded tensor (stride 0) in a component's state cannot be written in place: the
  restore raised half-way through copying into the live tensors, leaving a mix.
* Saving the same step again compares the live state with it: a conjugate view raised.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from unbroken.ckpt import Checkpointer, TrainState


class _Odd:
    """A component whose state holds views as a loop may keep them."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.t = {
            "plain": torch.randn(4, generator=g),
            "conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
            "neg": torch.randn(3, dtype=torch.complex64, generator=g).conj().imag,
            "expand": torch.randn(1, 3, generator=g).expand(4, 3),
        }

    def state_dict(self) -> dict[str, Any]:
        return dict(self.t)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = dict(sd)


def _values(odd: _Odd) -> dict[str, torch.Tensor]:
    return {k: v.resolve_conj().resolve_neg().clone() for k, v in odd.t.items()}


@pytest.mark.parametrize("async_save", [False, True])
def test_views_restore_with_their_values(tmp_path, async_save: bool) -> None:
    saved = _Odd(0)
    ck = Checkpointer(str(tmp_path), TrainState(extras={"odd": saved}), async_save=async_save)
    ck.save(1)
    ck.save(1)  # the same step again: compared with the live state, bit-identical, a no-op
    ck.close()
    want = _values(saved)

    live = _Odd(1)
    ck2 = Checkpointer(str(tmp_path), TrainState(extras={"odd": live}), quiet=True)
    assert ck2.restore() == 1
    ck2.close()
    got = _values(live)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
