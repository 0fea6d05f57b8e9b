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


def test_counters_defaultdicts_and_sets_come_back_as_what_they_were(tmp_path) -> None:
    """A component's state with a ``Counter`` or ``defaultdict(int)`` came back as a plain
    dict, so the first count of a new key after the resume raised ``KeyError``; a set could
    not be saved at all. Each comes back as its type (torch.save and DCP pickle them)."""
    from collections import Counter, defaultdict

    from unbroken.ckpt import Checkpointer

    class Seen:
        def __init__(self) -> None:
            self.counts: Counter[str] = Counter()
            self.by_len: defaultdict[int, list[str]] = defaultdict(list)
            self.ids: set[str] = set()
            self.kinds: frozenset[object] = frozenset()

        def state_dict(self) -> dict:
            return {
                "counts": self.counts,
                "by_len": self.by_len,
                "ids": self.ids,
                "kinds": self.kinds,
            }

        def load_state_dict(self, sd: dict) -> None:
            self.counts, self.by_len, self.ids, self.kinds = (
                sd["counts"],
                sd["by_len"],
                sd["ids"],
                sd["kinds"],
            )

    a = Seen()
    for w in ("ab", "c", "ab"):
        a.counts[w] += 1
        a.by_len[len(w)].append(w)
        a.ids.add(w)
    a.kinds = frozenset({"x", ("t", 1)})
    Checkpointer(str(tmp_path), TrainState(extras={"seen": a})).save(1)
    b = Seen()
    Checkpointer(str(tmp_path), TrainState(extras={"seen": b})).restore()
    assert type(b.counts) is Counter and b.counts == a.counts
    assert (
        type(b.by_len) is defaultdict and b.by_len.default_factory is list and b.by_len == a.by_len
    )
    assert (
        type(b.ids) is set and b.ids == a.ids and type(b.kinds) is frozenset and b.kinds == a.kinds
    )
    b.counts["new"] += 1  # KeyError when it came back as a dict
    b.by_len[9].append("x")


def test_a_set_encodes_to_the_same_bytes_under_any_string_hashing() -> None:
    """A set's order follows the process's string hashing (PYTHONHASHSEED): encoded as it
    iterates, the same state saved by two runs differed, and a final save compared with an
    existing step named a difference that is not there."""
    import json
    import subprocess
    import sys

    code = (
        "import json; from unbroken.ckpt import codec; "
        "print(json.dumps(codec.encode({'s': {'alpha', 'beta', 'gamma', 'delta', ('t', 1), 7}}, None)))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outs) == 1, outs
    assert codec.decode(json.loads(outs.pop()))["s"] == {
        "alpha",
        "beta",
        "gamma",
        "delta",
        ("t", 1),
        7,
    }


def test_crafted_counting_and_set_tags_are_refused_without_running_anything() -> None:
    """The state file is untrusted: a defaultdict naming any factory but the plain types
    (``os.system``), a set holding an unhashable item, a counter of no mapping: each a
    ValueError (a damaged checkpoint: the fall-back), nothing imported or called."""
    with pytest.raises(ValueError, match="defaultdict of 'system'"):
        codec.decode({"__ub__": "defaultdict", "factory": "system", "map": {}})
    with pytest.raises(ValueError, match="unhashable"):
        codec.decode({"__ub__": "set", "items": [[1, 2]]})
    with pytest.raises(ValueError, match="holds no mapping"):
        codec.decode({"__ub__": "counter", "map": [1]})


def test_a_defaultdict_of_a_lambda_is_saved_as_a_dict_and_said_once(caplog) -> None:
    import logging
    from collections import defaultdict

    codec._told.discard("x")
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        for _ in range(2):
            back = codec.decode(codec.encode({"x": defaultdict(lambda: 0, a=1)}, None))
    assert back == {"x": {"a": 1}} and type(back["x"]) is dict
    said = [r.getMessage() for r in caplog.records if "defaultdict" in r.getMessage()]
    assert len(said) == 1 and "'x'" in said[0], said


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
