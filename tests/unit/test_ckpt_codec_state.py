"""Codec round trip, TrainState validation, accumulation guard, RNG capture/restore."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from unbroken.ckpt import TrainState, codec, rng


def test_codec_round_trip_all_supported_types() -> None:
    obj = {
        "i": 3,
        "f": 0.1,
        "nan": float("nan"),
        "inf": float("-inf"),
        "s": "x/y",
        "none": None,
        "b": True,
        "tup": (1, (2.5, "a")),
        "lst": [1, [2, 3]],
        "intkeys": {0: "a", 1: {"z": 2}},
        "bytes": b"\x00\xff",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "dev": torch.device("cpu"),
        "nd": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "npf": np.float32(1.5),
        "t": torch.arange(6.0).reshape(2, 3),
        "state": {0: {"exp_avg": torch.ones(2)}},
    }
    tensors: dict[str, torch.Tensor] = {}
    tree = codec.encode(obj, tensors)
    assert set(tensors) == {"t", "state/0/exp_avg"}
    back = codec.decode(tree, tensors)
    assert back["tup"] == (1, (2.5, "a")) and isinstance(back["tup"], tuple)
    assert back["intkeys"] == {0: "a", 1: {"z": 2}}
    assert back["dtype"] is torch.bfloat16 and back["size"] == torch.Size([2, 3])
    assert back["nd"].dtype == np.uint32 and np.array_equal(back["nd"], obj["nd"])
    assert isinstance(back["npf"], np.float32)
    assert back["nan"] != back["nan"] and back["inf"] == float("-inf")
    assert back["bytes"] == b"\x00\xff"
    # inline tensors (no sink) survive exactly, including odd dtypes
    for t in (torch.randn(3).bfloat16(), torch.tensor(True), torch.empty(0, 4)):
        out = codec.decode(codec.encode(t, None))
        assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def test_codec_rejects_arbitrary_objects_with_the_path() -> None:
    class Thing:
        pass

    with pytest.raises(TypeError, match=r"'optim/extra'.*Thing"):
        codec.encode({"optim": {"extra": Thing()}}, {})
    with pytest.raises(ValueError, match="unknown tag"):
        codec.decode({"__ub__": "pickle", "x": 1})


def test_trainstate_rejects_non_stateful_and_names_it() -> None:
    with pytest.raises(TypeError, match="'extra.tokenizer'.*state_dict"):
        TrainState(model=torch.nn.Linear(2, 2), extras={"tokenizer": object()})
    with pytest.raises(TypeError, match="numpy_generators"):
        TrainState(numpy_generators={"g": np.random.RandomState(0)})  # type: ignore[dict-item]


def test_save_inside_accumulation_cycle_is_refused() -> None:
    st = TrainState(model=torch.nn.Linear(2, 2))
    st.micro_step = 1
    with pytest.raises(RuntimeError, match="micro_step=1"):
        st.check_saveable()
    st.micro_step = 0
    st.check_saveable()


def test_multiple_models_get_distinct_names() -> None:
    st = TrainState(model={"g": torch.nn.Linear(2, 2), "d": torch.nn.Linear(2, 1)})
    assert set(st.components) == {"model.g", "model.d"}


def _draws(g: np.random.Generator) -> tuple[float, float, float, float]:
    return random.random(), float(np.random.rand()), float(g.random()), float(torch.rand(1))


def test_rng_restore_continues_every_stream() -> None:
    g = np.random.default_rng(7)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws(g)
    saved = codec.decode(codec.encode(rng.capture({"g": g}), None))  # through JSON form
    expected = [_draws(g) for _ in range(3)]
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    g2 = np.random.default_rng(123)
    rng.restore(saved, {"g": g2})
    assert [_draws(g2) for _ in range(3)] == expected


def test_rng_restore_missing_generator_is_clear() -> None:
    saved = rng.capture({})
    with pytest.raises(ValueError, match="'shuffle'"):
        rng.restore(saved, {"shuffle": np.random.default_rng(0)})


def test_rng_derive_is_deterministic_per_rank_and_step() -> None:
    rng.derive(0, 1, 100)
    a = _draws(np.random.default_rng(0))[1:]
    rng.derive(0, 1, 100)
    b = _draws(np.random.default_rng(0))[1:]
    rng.derive(0, 2, 100)
    c = _draws(np.random.default_rng(0))[1:]
    assert a == b and a != c


class _Box:
    def __init__(self) -> None:
        self.t = torch.zeros(2)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.t.copy_(sd["t"])


def test_sharing_defaults_and_declarations() -> None:
    m = torch.nn.Linear(2, 2)
    st = TrainState(model=m, optimizer=torch.optim.SGD(m.parameters()), extras={"h": _Box()})
    assert st.sharing == {"model": "replicated", "optimizer": "replicated", "extra.h": "per_rank"}
    st = TrainState(
        model=m, extras={"h": _Box(), "s": _Box()}, replicated=["extra.s"], per_rank=["model"]
    )
    assert st.sharing == {"model": "per_rank", "extra.h": "per_rank", "extra.s": "replicated"}
    with pytest.raises(ValueError, match=r"'extra\.nope'.*\['extra\.h', 'model'\]"):
        TrainState(model=m, extras={"h": _Box()}, replicated=["extra.nope"])
    with pytest.raises(ValueError, match="both replicated and per_rank"):
        TrainState(model=m, replicated=["model"], per_rank=["model"])
    with pytest.raises(ValueError, match="per_rank_on_resize='drop'"):
        TrainState(model=m, per_rank_on_resize="drop")


def test_ddp_wrapped_model_is_unwrapped(tmp_path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        m = torch.nn.Linear(2, 2)
        st = TrainState(model=DDP(m), ema={"a": DDP(torch.nn.Linear(2, 2))})
        assert st.components["model"] is m
        assert set(st.state_dict()["components"]["model"]) == {"weight", "bias"}
        assert isinstance(st.components["ema.a"], torch.nn.Linear)
    finally:
        dist.destroy_process_group()
