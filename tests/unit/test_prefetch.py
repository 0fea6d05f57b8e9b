"""DevicePrefetcher: pass-through semantics, nested batches, delivered-state counting."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from unbroken.data.feed.prefetch import (
    DevicePrefetcher,
    _HostCopier,
    _InFlight,
    batch_nbytes,
    map_tensors,
)


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    meta: dict[str, Any]
    name: str = "b"


class CountingLoader:
    """A Stateful iterable: batch i is tensor([i, i]); state = batches yielded so far.

    Mimics a StatefulLoader: ``iter()`` resumes from the loaded position.
    """

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n = n
        self.pos = 0
        self.pulled = 0  # batches handed out in total (sees prefetching)
        self.fail_at = fail_at

    def __iter__(self):
        while self.pos < self.n:
            i = self.pos
            if i == self.fail_at:
                raise OSError(f"shard for batch {i} unreadable")
            self.pos += 1
            self.pulled += 1
            yield {"x": torch.tensor([i, i]), "idx": i}
        self.pos = 0  # next pass is a new epoch

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["yielded"]


def queued(loader: Any, depth: int = 3, transform: Any = None) -> DevicePrefetcher:
    """The CUDA path's queue logic with host 'copies', so it runs on CPU."""
    return DevicePrefetcher(
        loader, depth=depth, transform=transform, _copier=_HostCopier(transform)
    )


def nested(i: int) -> Any:
    return {
        "a": torch.full((2,), i),
        "pair": Pair(torch.zeros(1), torch.ones(1)),
        "list": [torch.arange(3), "text", 7, None],
        "tuple": (torch.tensor(1.5),),
        "dc": Batch(torch.ones(2, 2), {"k": torch.zeros(3)}),
        "od": collections.OrderedDict(z=torch.ones(1)),
    }


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_passthrough_returns_the_same_objects(device: Any) -> None:
    data = [nested(i) for i in range(4)]
    p = DevicePrefetcher(data, device=device)
    assert p.passthrough and p.device == torch.device("cpu")
    out = list(p)
    assert len(out) == 4 and all(o is d for o, d in zip(out, data, strict=True))
    assert list(p) == out  # a second pass restarts, like DataLoader


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_requested_without_cuda_passes_through(caplog: pytest.LogCaptureFixture) -> None:
    data = [torch.ones(2)]
    p = DevicePrefetcher(data, device="cuda")
    assert p.passthrough
    assert next(iter(p)) is data[0]
    assert "CUDA is not available" in caplog.text


def test_passthrough_applies_transform() -> None:
    p = DevicePrefetcher([torch.ones(2), torch.ones(2) * 2], transform=lambda b: b * 10)
    assert [t.tolist() for t in p] == [[10.0, 10.0], [20.0, 20.0]]


def test_map_tensors_rebuilds_every_container_type() -> None:
    b = nested(3)
    out = map_tensors(lambda t: t + 1, b)
    assert type(out["pair"]) is Pair and out["pair"].y.item() == 2
    assert type(out["dc"]) is Batch and out["dc"].name == "b"
    assert torch.equal(out["dc"].meta["k"], torch.ones(3))
    assert out["list"][1:] == ["text", 7, None]
    assert type(out["tuple"]) is tuple and out["tuple"][0].item() == 2.5
    assert type(out["od"]) is collections.OrderedDict
    assert torch.equal(out["a"], torch.full((2,), 4))
    # defaultdict cannot be rebuilt from a dict: it degrades to a plain dict, values mapped
    dd: collections.defaultdict[str, Any] = collections.defaultdict(list, {"t": torch.zeros(1)})
    assert map_tensors(lambda t: t + 1, dd) == {"t": torch.ones(1)}
    assert torch.equal(b["a"], torch.full((2,), 3))  # input untouched


def test_batch_nbytes_counts_nested_tensors() -> None:
    b = {
        "x": torch.zeros(4, dtype=torch.float32),
        "y": [torch.zeros(2, dtype=torch.int64)],
        "s": "skip",
    }
    assert batch_nbytes(b) == 4 * 4 + 2 * 8


def test_queued_path_delivers_everything_in_order_for_nested_batches() -> None:
    data = [nested(i) for i in range(7)]
    for depth in (1, 2, 5, 10):
        out = list(queued(data, depth=depth))
        assert [int(o["a"][0]) for o in out] == list(range(7))


def test_state_counts_delivered_not_prefetched_batches() -> None:
    loader = CountingLoader(10)
    p = queued(loader, depth=3)
    it = iter(p)
    assert p.state_dict() == {"yielded": 0}
    got = [next(it)["idx"] for _ in range(2)]
    assert got == [0, 1]
    # 2 delivered + 3 in flight have left the loader...
    assert loader.pulled == 5 and loader.state_dict() == {"yielded": 5}
    assert p.in_flight == 3
    # ...but only the delivered ones are consumed
    sd = p.state_dict()
    assert sd == {"yielded": 2}

    # resume in a fresh loader + prefetcher: exactly the remainder, nothing lost to prefetch
    loader2 = CountingLoader(10)
    p2 = queued(loader2, depth=3)
    p2.load_state_dict(sd)
    assert p2.state_dict() == {"yielded": 2}
    rest = [b["idx"] for b in p2]
    assert got + rest == list(range(10))
    assert p2.state_dict() == {"yielded": 10}


def test_state_snapshot_is_a_copy_not_the_live_dict() -> None:
    class Mutating(CountingLoader):
        def __init__(self, n: int) -> None:
            super().__init__(n)
            self._sd = {"yielded": 0}

        def state_dict(self) -> dict[str, int]:
            self._sd["yielded"] = self.pos  # returns the same dict object every time
            return self._sd

    p = queued(Mutating(6), depth=2)
    it = iter(p)
    next(it)
    assert p.state_dict() == {"yielded": 1}


def test_load_state_dict_mid_iteration_drops_in_flight_batches() -> None:
    loader = CountingLoader(8)
    p = queued(loader, depth=3)
    it = iter(p)
    for _ in range(3):
        next(it)
    assert p.in_flight == 3
    p.load_state_dict({"yielded": 1})
    assert p.in_flight == 0
    assert [b["idx"] for b in p] == list(range(1, 8))


def test_passthrough_state_is_the_live_loader_state() -> None:
    loader = CountingLoader(5)
    p = DevicePrefetcher(loader)
    it = iter(p)
    next(it), next(it)
    assert p.state_dict() == {"yielded": 2}
    p.load_state_dict({"yielded": 4})
    assert [b["idx"] for b in p] == [4]


def test_loader_error_surfaces_after_the_batches_already_in_flight() -> None:
    p = queued(CountingLoader(10, fail_at=4), depth=3)
    it = iter(p)
    got = []
    with pytest.raises(OSError, match="batch 4 unreadable"):
        while True:
            got.append(next(it)["idx"])
    assert got == [0, 1, 2, 3]


def test_exhausted_iterator_keeps_raising_until_iter_restarts() -> None:
    p = queued([torch.zeros(1)], depth=2)
    it = iter(p)
    next(it)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    assert len(list(p)) == 1


def test_copy_source_kept_alive_until_copier_reports_done() -> None:
    class SlowCopier(_HostCopier):
        def __init__(self) -> None:
            super().__init__(None)
            self.finished = False
            self.delivered: list[Any] = []

        def deliver(self, entry: _InFlight) -> None:
            self.delivered.append(entry.batch)

        def done(self, entry: _InFlight) -> bool:
            return self.finished

    c = SlowCopier()
    p = DevicePrefetcher([torch.full((1,), i) for i in range(6)], depth=2, _copier=c)
    it = iter(p)
    next(it), next(it), next(it)
    assert len(c.delivered) == 3
    assert len(p._retiring) == 3  # sources held: their "copies" have not completed
    assert all(e.host is not None and e.batch is None for e in p._retiring)
    c.finished = True
    next(it)
    assert len(p._retiring) == 0


def test_works_over_a_real_multiworker_dataloader() -> None:
    class Numbers(IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            for i in range(wid, 24, nw):
                yield {"x": torch.tensor([i])}

    loader = DataLoader(Numbers(), batch_size=4, num_workers=2)
    seen = sorted(int(v) for b in queued(loader, depth=2) for v in b["x"])
    assert seen == list(range(24))


def test_bad_arguments_name_the_option() -> None:
    with pytest.raises(ValueError, match="depth=0"):
        DevicePrefetcher([], depth=0)
    with pytest.raises(ValueError, match="transform=3"):
        DevicePrefetcher([], transform=3)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="has no state_dict"):
        DevicePrefetcher([1, 2]).state_dict()
    with pytest.raises(RuntimeError, match="no load_state_dict"):
        DevicePrefetcher([1, 2]).load_state_dict({})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefetch_copies_transforms_and_counts_state() -> None:
    loader = CountingLoader(12)
    seen_streams = []

    def transform(b: dict[str, Any]) -> dict[str, Any]:
        seen_streams.append(torch.cuda.current_stream())
        return {**b, "x": b["x"].float() * 2}

    p = DevicePrefetcher(loader, device="cuda", depth=3, transform=transform)
    assert not p.passthrough
    it = iter(p)
    first = [next(it) for _ in range(4)]
    assert all(b["x"].is_cuda for b in first)
    assert [b["x"].tolist() for b in first] == [[2.0 * i, 2.0 * i] for i in range(4)]
    assert p.state_dict() == {"yielded": 4} and loader.pulled == 7
    assert all(s != torch.cuda.default_stream() for s in seen_streams)  # side stream
    rest = [b["idx"] for b in it]
    assert rest == list(range(4, 12))


def test_new_pass_after_break_rewinds_the_loader_to_the_delivered_batch() -> None:
    loader = CountingLoader(9)
    p = queued(loader, depth=3)
    for b in p:
        if b["idx"] == 2:
            break
    assert loader.pulled == 6  # three more were prefetched
    # a new pass continues after the last delivered batch, skipping none
    assert [b["idx"] for b in p] == list(range(3, 9))
    # and a pass after a complete epoch starts the next epoch from its beginning
    assert [b["idx"] for b in p] == list(range(9))


def test_close_puts_the_loader_back_at_the_delivered_position() -> None:
    loader = CountingLoader(9)
    p = queued(loader, depth=2)
    it = iter(p)
    next(it)
    p.close()
    assert loader.state_dict() == {"yielded": 1} == p.state_dict()
