"""One frozen config dataclass per component (issue 15): CheckpointConfig, ArchiveConfig,
LoaderConfig. Each field documented; frozen; a bad value refused naming the option; the old
keyword API builds the same config, with its defaults read from the dataclass, and runs the
same; torch's Stateful is the protocol; one plain_json."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import uuid
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful as TorchStateful

import unbroken
import unbroken.ckpt
from ckptkit import small_state, train
from datakit import ids_collate
from unbroken.ckpt import ArchiveConfig, CheckpointConfig, Checkpointer
from unbroken.ckpt.archive.remote import Archive
from unbroken.ckpt.archive.uploader import BackgroundUploader
from unbroken.common.jsonable import plain_json
from unbroken.common.metrics import MetricLog
from unbroken.data import (
    CacheConfig,
    DatasetConfig,
    DevicePrefetcher,
    LoaderConfig,
    StatefulLoader,
    StreamingDataset,
)

CONFIGS = (CheckpointConfig, ArchiveConfig, LoaderConfig, DatasetConfig, CacheConfig)


def _field_docs(cls: type) -> dict[str, str]:
    """{field: the string literal right below it in the class body} (Sphinx's attribute
    docstrings)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    return {
        a.target.id: b.value.value
        for a, b in zip(body, body[1:], strict=False)
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
        and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
        and isinstance(b.value.value, str)
    }  # fmt: skip


def _url() -> str:
    return f"memory://configs-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_documented_in_one_line(cls: type) -> None:
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        assert f.name in docs, f"{cls.__name__}.{f.name} has no docstring line"
        assert docs[f.name].strip() and "\n" not in docs[f.name].strip(), f.name


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_frozen(cls: type) -> None:
    cfg = cls(_url()) if cls is ArchiveConfig else cls()
    name = dataclasses.fields(cls)[-1].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, name, getattr(cfg, name))


def test_archive_config_copies_storage_options_and_hides_them() -> None:
    opts = {"key": "secret-value"}
    cfg = ArchiveConfig(_url(), storage_options=opts)
    opts["key"] = "changed"
    assert cfg.storage_options == {"key": "secret-value"}
    assert "secret-value" not in repr(cfg)
    assert hash(cfg) == hash(dataclasses.replace(cfg))


BAD = [
    (CheckpointConfig, {"every_steps": 0}, "every_steps=0"),
    (CheckpointConfig, {"every_seconds": -1.0}, "every_seconds=-1.0"),
    (CheckpointConfig, {"every_seconds": float("nan")}, "every_seconds=nan"),
    (CheckpointConfig, {"keep_last": 0}, "keep_last=0"),
    (CheckpointConfig, {"keep_every": 2.5}, "keep_every=2.5"),
    (CheckpointConfig, {"io_threads": 0}, "io_threads=0"),
    (CheckpointConfig, {"async_save": "yes"}, "async_save='yes'"),
    (CheckpointConfig, {"distributed": 1}, "distributed=1"),
    (CheckpointConfig, {"archive": "s3://b/x"}, "archive='s3://b/x'"),
    (ArchiveConfig, {"url": ""}, "url=''"),
    (ArchiveConfig, {"every": 0}, "every=0"),
    (ArchiveConfig, {"keep_last": True}, "keep_last=True"),
    (ArchiveConfig, {"retries": -1}, "retries=-1"),
    (ArchiveConfig, {"backoff_s": -0.1}, "backoff_s=-0.1"),
    (ArchiveConfig, {"threads": 0}, "threads=0"),
    (ArchiveConfig, {"max_pending": 0}, "max_pending=0"),
    (ArchiveConfig, {"storage_options": ["a"]}, "storage_options=['a']"),
    (LoaderConfig, {"batch_size": 0}, "batch_size=0"),
    (LoaderConfig, {"last_batch": "keep"}, "last_batch='keep'"),
    (LoaderConfig, {"on_dataset_change": "ignore"}, "on_dataset_change='ignore'"),
    (LoaderConfig, {"num_workers": -1}, "num_workers=-1"),
    (LoaderConfig, {"prefetch_factor": 2}, "prefetch_factor=2 needs num_workers"),
    (LoaderConfig, {"num_workers": 2, "prefetch_factor": 0}, "prefetch_factor=0"),
    (LoaderConfig, {"persistent_workers": True}, "persistent_workers=True needs num_workers"),
    # torch's own AssertionError "_SingleProcessDataLoaderIter requires timeout == 0" before
    (LoaderConfig, {"timeout": 5}, "timeout=5 needs num_workers > 0"),
    (LoaderConfig, {"timeout": -1}, "timeout=-1"),
    (LoaderConfig, {"pin_memory": None}, "pin_memory=None"),
    (DatasetConfig, {"seed": -1}, "seed=-1"),
    (DatasetConfig, {"on_corrupt": "ignore"}, "on_corrupt='ignore'"),
    (DatasetConfig, {"rank": 1}, "rank=1 world_size=None: pass both or neither"),
    (DatasetConfig, {"rank": 2, "world_size": 2}, "rank=2 world_size=2"),
    (DatasetConfig, {"shuffle_window": 0}, "shuffle_window=0"),
    (CacheConfig, {"cache_limit": "lots"}, "cache_limit='lots'"),
    (CacheConfig, {"threads": 0}, "threads=0"),
    (CacheConfig, {"timeout": 0}, "timeout=0"),
]


@pytest.mark.parametrize(("cls", "kw", "named"), BAD, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_value_names_option_and_value(cls: type, kw: dict[str, Any], named: str) -> None:
    if cls is ArchiveConfig and "url" not in kw:
        kw = {"url": _url(), **kw}
    with pytest.raises(ValueError, match=f"{cls.__name__}.{named}".replace("[", r"\[")):
        cls(**kw)


def test_checkpointer_takes_a_config_and_field_overrides(tmp_path) -> None:
    """issue 24 item 3: one way in. ``Checkpointer(root, state, config, **overrides)``:
    the overrides are fields of the config, applied with ``dataclasses.replace``; anything
    else is a TypeError that lists the fields."""
    st, m, opt = small_state()
    url = _url()
    cfg = CheckpointConfig(every_steps=2, keep_last=2, archive=ArchiveConfig(url, every=2))
    ck = Checkpointer(str(tmp_path / "a"), st, cfg, keep_every=4, io_threads=3)
    try:
        assert ck.config == dataclasses.replace(cfg, keep_every=4, io_threads=3)
        assert Checkpointer(str(tmp_path / "b"), st).config == CheckpointConfig()
        inline = Checkpointer(str(tmp_path / "c"), st, every_steps=500, keep_last=3)
        assert inline.config == CheckpointConfig(every_steps=500, keep_last=3)
        for _ in range(6):
            train(st, m, opt, 1)
            ck.maybe_save()
        ck.wait()
        assert [i.step for i in ck.list()] == [4, 6]
    finally:
        ck.close()
    with pytest.raises(TypeError, match=r"archive_every.*fields of CheckpointConfig: every_steps"):
        Checkpointer(str(tmp_path), st, archive_every=2)
    with pytest.raises(ValueError, match=r"CheckpointConfig.keep_last=0"):
        Checkpointer(str(tmp_path), st, cfg, keep_last=0)  # validated again
    with pytest.raises(ValueError, match=r"pass archive=ArchiveConfig\('memory://"):
        Checkpointer(str(tmp_path), st, archive=url)
    with pytest.raises(TypeError, match="takes a CheckpointConfig"):
        Checkpointer(str(tmp_path), st, config=LoaderConfig())  # type: ignore[arg-type]


def test_archive_and_uploader_read_the_config() -> None:
    url = _url()
    cfg = ArchiveConfig(url, retries=1, backoff_s=0.0, threads=2, keep_last=3, max_pending=4)
    arch = Archive(cfg)
    assert arch.config == cfg
    assert Archive(url, retries=1, backoff_s=0.0, threads=2).config == dataclasses.replace(
        cfg, keep_last=None, max_pending=2
    )
    assert Archive(cfg, threads=3).config == dataclasses.replace(cfg, threads=3)
    up = BackgroundUploader(arch)
    over = BackgroundUploader(arch, keep_last=1)
    try:
        assert up.config == cfg
        assert over.config == dataclasses.replace(cfg, keep_last=1)
        with pytest.raises(TypeError, match="fields of ArchiveConfig: url"):
            BackgroundUploader(arch, every_steps=1)
    finally:
        up.close()
        over.close()


def test_data_components_take_one_config_and_its_fields_as_keywords(stream_data) -> None:
    """Issue 24 item 3: StreamingDataset(source, DatasetConfig, **fields) and
    StatefulLoader(dataset, LoaderConfig, **fields): the keywords replace fields of the config
    (validated again), an unknown one is a TypeError that lists the fields."""
    root = stream_data("tar")
    cfg = DatasetConfig(seed=3, shuffle_window=40)
    ds = StreamingDataset(root, cfg, with_ids=True)
    assert ds.config == dataclasses.replace(cfg, with_ids=True)
    assert StreamingDataset(root).config == DatasetConfig()
    with pytest.raises(TypeError, match=r"cache_dir; its options are the fields of DatasetConfig"):
        StreamingDataset(root, cache_dir="/tmp/x")
    with pytest.raises(ValueError, match=r"DatasetConfig.seed=-1"):
        StreamingDataset(root, cfg, seed=-1)
    lcfg = LoaderConfig(batch_size=8, last_batch="drop")
    ld = StatefulLoader(ds, lcfg, num_workers=2, collate_fn=ids_collate)
    assert ld.config == dataclasses.replace(lcfg, num_workers=2)
    assert StatefulLoader(ds).config == LoaderConfig()
    with pytest.raises(ValueError, match="prefetch_factor=2 needs num_workers"):
        StatefulLoader(ds, lcfg, prefetch_factor=2)
    assert not hasattr(ld, "batch_size") and not hasattr(ds, "seed")  # no copies on self


def test_stateful_is_torchs_protocol(tmp_path, stream_data) -> None:
    assert unbroken.ckpt.Stateful is TorchStateful
    st, _, _ = small_state()
    loader = StatefulLoader(StreamingDataset(stream_data("tar"), seed=0), batch_size=4)
    ml = MetricLog(str(tmp_path / "m.jsonl"))
    try:
        for obj in (st, loader, DevicePrefetcher(loader, device="cpu"), ml):
            assert isinstance(obj, TorchStateful), type(obj).__name__
    finally:
        ml.close()
    with pytest.raises(TypeError, match="no state_dict"):
        unbroken.ckpt.TrainState(extras={"x": object()})


def test_configs_are_everyday_names() -> None:
    assert unbroken.CheckpointConfig is CheckpointConfig
    assert unbroken.LoaderConfig is LoaderConfig
    assert unbroken.ckpt.ArchiveConfig is ArchiveConfig


def test_plain_json() -> None:
    assert plain_json({1: (2, 3.5), "a": None}) == {"1": [2, 3.5], "a": None}
    assert plain_json({"t": torch.zeros(1)}) is None
    assert plain_json({"t": object()}, lossy=True)["t"].startswith("<object object")
