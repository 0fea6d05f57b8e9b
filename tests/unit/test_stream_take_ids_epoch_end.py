"""``take_ids`` at an epoch end lists what ``with_ids=True`` batches handed out.

The epoch's last global step is partial unless the global batch divides the epoch: under
``last_batch="pad"`` (the default) it repeats samples just before it, under ``"drop"`` it is
not delivered at all. The ids a loop consumed are those of the batches it got: the repeats
once more for "pad", none of the dropped samples for "drop" - on one rank and, interleaved in
one-rank order, on two.
"""

from __future__ import annotations

import pytest

from datakit import build_tar_dataset
from unbroken.common.metrics import _interleave
from unbroken.data import StatefulLoader, StreamingDataset


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tar_dataset(str(tmp_path_factory.mktemp("ids") / "d"), 23)


@pytest.mark.parametrize("world,batch", [(1, 4), (2, 2), (2, 3)])
@pytest.mark.parametrize("policy", ["pad", "drop", "short"])
def test_take_ids_are_the_ids_handed_out_across_epoch_ends(data, policy, world, batch) -> None:
    its = [
        StatefulLoader(
            StreamingDataset(
                data, seed=3, shuffle_window=8, with_ids=True, rank=r, world_size=world
            ),
            batch_size=batch,
            last_batch=policy,
        ).forever()
        for r in range(world)
    ]
    handed: list[int] = []
    for step in range(1, 17):  # 23 samples: several epoch ends, each with a partial step
        handed += _interleave([next(it)["__id__"].tolist() for it in its])
        if step % 3 == 0 or step == 16:
            for it in its:
                assert it.take_ids() == handed, (step, policy)
            handed = []
