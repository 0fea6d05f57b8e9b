"""The sample ids a loop consumed, without ``with_ids`` and without a collective (issue 21,
"How to show it": the drill compares sample ids of the nanoGPT-style example).

``loader.forever().take_ids()`` lists the ids of every sample consumed since the last call,
every rank's, in one-rank order: exactly what ``with_ids=True`` batches would have handed out,
gathered with ``global_ids``. A batch the loop holds (``held_batches=1``) is not consumed yet;
after a restore the count starts at the restored position.
"""

from __future__ import annotations

import numpy as np
import pytest

from unbroken.common.metrics import _interleave
from unbroken.data import StatefulLoader, StreamingDataset
from unbroken.data.tokens.flat import index_flat


@pytest.fixture(scope="module")
def flat(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("flat") / "train.bin")
    (np.arange(2_000) % 65_536).astype(np.uint16).tofile(path)
    index_flat(path, vocab_size=65_536, fsync=False)
    return path


def _stream(path: str, windows: str, rank: int = 0, world: int = 1, batch: int = 4):
    ds = StreamingDataset(
        path, seq_len=16, windows=windows, seed=3, with_ids=True, rank=rank, world_size=world
    )
    return StatefulLoader(ds, batch_size=batch, xy=True, held_batches=1).forever()


@pytest.mark.parametrize("windows", ["random", "fixed"])
def test_take_ids_lists_what_with_ids_handed_out_less_the_held_batch(flat, windows):
    it = _stream(flat, windows)
    *_, ids = next(it)  # the first batch, held
    assert it.take_ids() == []  # held: nothing consumed yet
    seen: list[int] = []
    for step in range(40):  # 40 steps x 4 samples: past the end of the first epoch (117)
        seen += ids.tolist()  # the step consumes the batch it held
        *_, ids = next(it)  # and holds the next one
        if step % 7 == 6:
            assert it.take_ids() == seen, step
            seen = []
    assert it.take_ids() == seen


def test_take_ids_is_every_rank_in_one_rank_order(flat):
    """Two ranks consume the global batch between them; each lists all of it, the same."""
    one = _stream(flat, "random", batch=8)
    ranks = [_stream(flat, "random", r, 2, batch=4) for r in range(2)]
    for _ in range(5):
        want = next(one)[2].tolist()
        parts = [next(r)[2].tolist() for r in ranks]
        assert _interleave(parts) == want  # the batches themselves agree (D-ORDER)
    assert one.take_ids() == ranks[0].take_ids() == ranks[1].take_ids()


def test_take_ids_starts_at_the_restored_position(flat):
    it = _stream(flat, "random")
    batches = [next(it)[2].tolist() for _ in range(6)]
    state = it.state_dict()  # 5 consumed, the 6th held
    batches.append(next(it)[2].tolist())
    again = _stream(flat, "random")
    again.load_state_dict(state)
    assert again.take_ids() == []
    for _ in range(3):
        next(again)  # the held 6th again, the 7th, and the 8th (now held)
    assert again.take_ids() == batches[5] + batches[6]
