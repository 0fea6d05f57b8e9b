"""Every public call that takes a path takes a ``pathlib.Path`` too (as ``torch.save``,
``open`` and DCP's ``checkpoint_id`` do). ``Checkpointer(Path(...))`` raised "argument of
type 'PosixPath' is not iterable"; ``StreamingDataset(Path(...))``, ``pack``, ``stage``,
``tokenize`` failed the same way or with an AttributeError."""

from __future__ import annotations

from pathlib import Path

import torch

from unbroken.ckpt import CheckpointConfig, Checkpointer, TrainState, read_checkpoint
from unbroken.data import (
    CacheConfig,
    DatasetManifest,
    Source,
    StatefulLoader,
    StreamingDataset,
    index_directory,
    pack,
    stage,
    tokenize,
)


def test_paths_are_accepted_wherever_a_path_string_is(tmp_path: Path) -> None:
    m = torch.nn.Linear(2, 2)
    ck = Checkpointer(tmp_path / "ckpt", TrainState(model=m))
    ck.save(1)
    assert Checkpointer(tmp_path / "ckpt", TrainState(model=torch.nn.Linear(2, 2))).restore() == 1
    assert read_checkpoint(tmp_path / "ckpt")["counters"]["step"] == 1  # save(1) saved step 1
    assert CheckpointConfig(memory_dir=tmp_path / "mem").memory_dir == str(tmp_path / "mem")  # type: ignore[arg-type]

    pack(
        ({"__key__": f"{i:03d}", "x": b"1"} for i in range(5)),
        tmp_path / "ds",
        shard_size=10240,
        progress=False,
        fsync=False,
    )
    assert len(list(StreamingDataset(tmp_path / "ds", seed=0))) == 5
    assert len(list(StreamingDataset([Source(tmp_path / "ds")], seed=0))) == 5  # type: ignore[arg-type]
    assert (
        sum(1 for _ in StatefulLoader(StreamingDataset(tmp_path / "ds", seed=0), batch_size=2)) == 3
    )
    assert len(DatasetManifest.load(tmp_path / "ds").shards) >= 1
    assert index_directory(tmp_path / "ds", progress=False).manifest.num_samples == 5
    assert stage(tmp_path / "ds", tmp_path / "staged", progress=False).files_copied >= 2
    assert CacheConfig(cache_dir=tmp_path / "cache").cache_dir == str(tmp_path / "cache")  # type: ignore[arg-type]

    (tmp_path / "c.txt").write_text("hello world\n" * 20)
    r = tokenize(tmp_path / "c.txt", tmp_path / "tok", train_bpe_vocab=300, progress=False)
    assert r.tokens > 0
