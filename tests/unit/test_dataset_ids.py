"""``StreamingDataset(with_ids=True)``: each sample's id travels with the batch (dict samples
gain ``__id__``, token rows become ``(tokens, ids)``), the same sample keeps its id in every
epoch, for any worker count and across sources, and the ranks' ids interleave into the
one-rank order (what ``unbroken.common.metrics.global_ids`` does across a process group)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unbroken.common.metrics import _interleave
from unbroken.data.stream.dataset import Source, StreamingDataset
from unbroken.data.stream.loader import StatefulLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _ids(loader: StatefulLoader) -> list[int]:
    return [i for b in loader for i in b["__id__"].tolist()]


@pytest.mark.parametrize("workers", [0, 2])
def test_tar_batches_carry_ids_that_name_the_sample(stream_data, workers):
    ds = StreamingDataset(stream_data("tar"), seed=3, with_ids=True)
    loader = StatefulLoader(ds, batch_size=8, num_workers=workers, last_batch="short")
    seen = []
    for b in loader:
        assert b["__id__"].dtype == torch.int64 and len(b["__id__"]) == len(b["__key__"])
        # build_tar_dataset packs keys s00000.. in order: the id is the manifest position
        assert b["__id__"].tolist() == [int(k[1:]) for k in b["__key__"]]
        seen += b["__id__"].tolist()
    assert sorted(seen) == list(range(203)) and seen != sorted(seen)
    loader.set_epoch(1)  # another shuffle, the same ids for the same samples
    again = _ids(loader)
    assert sorted(again) == list(range(203)) and again != seen


def test_token_batches_are_tokens_and_ids(stream_data):
    root = stream_data("tokens")
    plain = StatefulLoader(StreamingDataset(root, seed=5), batch_size=4, last_batch="drop")
    loader = StatefulLoader(
        StreamingDataset(root, seed=5, with_ids=True),
        batch_size=4,
        num_workers=2,
        last_batch="drop",
    )
    rows: dict[int, torch.Tensor] = {}
    for ref, (tokens, ids) in zip(plain, loader, strict=True):
        assert torch.equal(tokens, ref) and tokens.shape == (4, 9)
        assert ids.dtype == torch.int64 and ids.shape == (4,)
        rows.update(zip(ids.tolist(), tokens, strict=True))
    loader.set_epoch(1)
    for tokens, ids in loader:
        for i, row in zip(ids.tolist(), tokens, strict=True):
            if i in rows:
                assert torch.equal(rows[i], row)  # an id always names the same sequence


def test_transforms_keep_the_id(stream_data):
    root = stream_data("tar")
    to_dict = StreamingDataset(root, transform=lambda s: {"n": len(s["bin"])}, with_ids=True)
    to_len = StreamingDataset(root, transform=lambda s: len(s["bin"]), with_ids=True)
    a, b = to_dict.read(0, np.arange(4)), to_len.read(0, np.arange(4))
    assert [s["__id__"] for s in a] == [i for _, i in b]
    assert [s["n"] for s in a] == [n for n, _ in b]
    n, ids = next(iter(StatefulLoader(to_len, batch_size=4)))
    assert n.tolist() == [s["n"] for s in a] and ids.tolist() == [s["__id__"] for s in a]


def test_mixture_ids_are_unique_across_sources(stream_data):
    ds = StreamingDataset(
        [Source(stream_data("tar"), 0.5), Source(stream_data("tar_b"), 0.5)], seed=0, with_ids=True
    )
    for s in ds.read(0, np.arange(120)):
        base = 0 if s["__key__"].startswith("s") else 203  # source 1 starts after source 0
        assert s["__id__"] == base + int(s["__key__"][1:])


def test_rank_ids_interleave_into_the_one_rank_order(stream_data):
    root = stream_data("tar")
    one = StatefulLoader(
        StreamingDataset(root, seed=7, with_ids=True, rank=0, world_size=1), batch_size=6
    )
    ranks = [
        StatefulLoader(
            StreamingDataset(root, seed=7, with_ids=True, rank=r, world_size=2), batch_size=3
        )
        for r in (0, 1)
    ]
    for ref, b0, b1 in zip(one, *ranks, strict=False):
        assert _interleave([b0["__id__"].tolist(), b1["__id__"].tolist()]) == ref["__id__"].tolist()
