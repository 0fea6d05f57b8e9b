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
# each component, and the config whose fields its keywords share (names and defaults)
COMPONENTS = (
    (Checkpointer, CheckpointConfig),
    (Archive, ArchiveConfig),
    (BackgroundUploader, ArchiveConfig),
)
# keywords whose None means "not given: the dataclass's default"
UNSET_IS_NONE = {("Archive", "storage_options")}


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


@pytest.mark.parametrize(("component", "cls"), COMPONENTS, ids=lambda c: c.__name__)
def test_keyword_defaults_are_the_dataclass_defaults(component: type, cls: type) -> None:
    """A default lives in the dataclass: every keyword named like a field defaults to it."""
    params = inspect.signature(component.__init__).parameters
    shared = [f for f in dataclasses.fields(cls) if f.name in params and f.name != "url"]
    assert len(shared) >= 3
    for f in shared:
        unset = (component.__name__, f.name) in UNSET_IS_NONE
        want = None if unset else f.default
        assert params[f.name].default == want, f"{component.__name__}({f.name}=)"


def test_checkpointer_keywords_equal_config(tmp_path) -> None:
    st, m, opt = small_state()
    url = _url()
    by_kw = Checkpointer(
        str(tmp_path / "a"),
        st,
        every_steps=2,
        keep_last=2,
        keep_every=4,
        async_save=True,
        io_threads=3,
        archive=url,
        archive_every=2,
        archive_keep_last=1,
        archive_options={"skip_instance_cache": True},
    )
    cfg = CheckpointConfig(
        every_steps=2,
        keep_last=2,
        keep_every=4,
        async_save=True,
        io_threads=3,
        archive=ArchiveConfig(
            url, every=2, keep_last=1, storage_options={"skip_instance_cache": True}
        ),
    )
    by_cfg = Checkpointer(str(tmp_path / "b"), st, config=cfg)
    try:
        assert by_kw.config == by_cfg.config == cfg
        assert Checkpointer(str(tmp_path / "c"), st).config == CheckpointConfig()
        # ... and they run the same: saves at the same steps, the same ones kept
        for ck in (by_kw, by_cfg):
            for _ in range(6):
                train(st, m, opt, 1)
                ck.maybe_save()
            st.step = 0
            ck.wait()
        assert [i.step for i in by_kw.list()] == [i.step for i in by_cfg.list()] == [4, 6]
    finally:
        by_kw.close()
        by_cfg.close()


def test_checkpointer_refuses_config_and_keywords(tmp_path) -> None:
    st, _, _ = small_state()
    with pytest.raises(ValueError, match=r"not both .*keep_last=5"):
        Checkpointer(str(tmp_path), st, config=CheckpointConfig(), keep_last=5)
    with pytest.raises(ValueError, match=r"not both .*archive="):
        Checkpointer(str(tmp_path), st, config=CheckpointConfig(), archive=_url())
    with pytest.raises(ValueError, match="archive_every given without archive=URL"):
        Checkpointer(str(tmp_path), st, archive_every=2)
    with pytest.raises(ValueError, match=r"ArchiveConfig.every=0 .*archive_every= sets every"):
        Checkpointer(str(tmp_path), st, archive=_url(), archive_every=0)
    with pytest.raises(TypeError, match="takes a CheckpointConfig"):
        Checkpointer(str(tmp_path), st, config=LoaderConfig())  # type: ignore[arg-type]


def test_archive_and_uploader_read_the_config() -> None:
    url = _url()
    cfg = ArchiveConfig(url, retries=1, backoff_s=0.0, threads=2, keep_last=3, max_pending=4)
    arch = Archive(cfg)
    assert arch.config == cfg and (arch.retries, arch.threads) == (1, 2)
    assert Archive(url, retries=1, backoff_s=0.0, threads=2).config == dataclasses.replace(
        cfg, keep_last=None, max_pending=2
    )
    with pytest.raises(ValueError, match="not both"):
        Archive(cfg, threads=3)
    up = BackgroundUploader(arch)
    over = BackgroundUploader(arch, keep_last=1)
    try:
        assert (up.max_pending, up.keep_last) == (4, 3)
        assert (over.max_pending, over.keep_last) == (4, 1)
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
