"""The worker -> main batch transport (shared-memory rings): exact round trips, slot reuse,
growth, fall-backs, and the StatefulLoader delivering the same objects with and without it."""

from __future__ import annotations

import pickle
from collections import OrderedDict, namedtuple
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch

from unbroken.data._transport import (
    RingReceiver,
    RingSender,
    Ticket,
    transport_available,
    worker_fds,
)
from unbroken.data.dataset import StreamingDataset
from unbroken.data.loader import StatefulLoader

pytestmark = [
    pytest.mark.skipif(not transport_available(), reason="needs os.memfd_create (Linux)"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
]

Pair = namedtuple("Pair", "a b")


def assert_same(got: Any, want: Any, path: str = "batch") -> None:
    """Equal values *and* identical types, all the way down."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def _cross(item: Any) -> Any:
    """What the worker queue does to an item: ForkingPickler out, pickle in."""
    return pickle.loads(ForkingPickler.dumps(item))


def _batches() -> list[Any]:
    rng = np.random.default_rng(0)
    return [
        [(f"{i:08d}", rng.bytes(4096)) for i in range(256)],  # the benchmark's shape
        [],
        {},
        (),
        None,
        b"",
        bytearray(b"abc"),
        {
            "key": ["a", "b"],
            "bin": [b"\x00" * 10, bytearray(b"xy"), memoryview(b"mv").tobytes()],
            "n": 3,
            "f": 0.5,
            "none": None,
            "flag": True,
            "nested": {"t": (1, (2, [3, {"deep": b"z" * 70_000}]))},
        },
        OrderedDict(x=1, y=[b"q"]),
        Pair(a=b"1", b="2"),
        {"x": np.arange(12, dtype=np.int32).reshape(3, 4), "s": np.float64(2.5)},
        [b"\xff" * (3 << 20)],  # bigger than the first ring's slots: the ring grows
        ["small", 1, b"s"],
    ]


def test_round_trip_gives_identical_objects():
    sender, receiver = RingSender(slots=4), RingReceiver()
    try:
        for want in _batches():
            shipped = sender.pack(want)
            assert isinstance(shipped, Ticket)
            assert_same(receiver.unpack(_cross(shipped)), want)
        # each slot reused many times over: the ring is recycled, not reallocated
        for i in range(20):
            want = [bytes([i]) * 5000, i]
            t = sender.pack(want)
            assert isinstance(t, Ticket) and t.fd is None
            assert_same(receiver.unpack(_cross(t)), want)
    finally:
        sender.close()
        receiver.close()


def test_batches_with_tensors_keep_torchs_path():
    """A tensor crosses as a file descriptor that must be claimed while the worker lives:
    such batches are left to torch's queue, which unpickles them on arrival."""
    sender = RingSender(slots=4)
    try:
        batch = {"t": torch.arange(6, dtype=torch.int16), "k": [b"x" * 100]}
        assert sender.pack(batch) is batch
        later = [b"y"]
        assert sender.pack(later) is later  # the stream's batches are alike: stays off
    finally:
        sender.close()


def test_busy_slots_fall_back_to_the_stock_path_instead_of_waiting():
    sender, receiver = RingSender(slots=2), RingReceiver()
    try:
        a, b, c = [b"a" * 100], [b"b" * 100], [b"c" * 100]
        ta, tb = sender.pack(a), sender.pack(b)
        assert isinstance(ta, Ticket) and isinstance(tb, Ticket)
        assert sender.pack(c) is c  # both slots unconsumed: c takes the pipe, unchanged
        assert receiver.unpack(c) is c  # non-tickets pass through
        assert_same(receiver.unpack(_cross(ta)), a)
        td = sender.pack(c)  # slot 0 is free again
        assert isinstance(td, Ticket)
        assert_same(receiver.unpack(_cross(tb)), b)
        assert_same(receiver.unpack(_cross(td)), c)
    finally:
        sender.close()
        receiver.close()


def test_growth_replaces_the_ring_and_the_size_cap_falls_back():
    sender, receiver = RingSender(slots=2, max_ring_bytes=8 << 20), RingReceiver()
    try:
        small = [b"x" * 1000]
        t1 = _cross(sender.pack(small))
        assert_same(receiver.unpack(t1), small)
        big = [b"y" * (2 << 20)]  # > 1 MiB slot: a new ring with 4 MiB slots... over the cap
        assert sender.pack(big) is big
        mid = [b"z" * (1 << 20)]  # 1.25 MiB -> 2 MiB slots, 2 slots: within 8 MiB
        t2 = _cross(sender.pack(mid))
        assert t2.ring != t1.ring and t2.fd is not None
        assert_same(receiver.unpack(t2), mid)
        assert list(receiver._rings) == [t2.ring]  # the superseded ring is unmapped
        t3 = _cross(sender.pack(small))
        assert t3.ring == t2.ring
        assert_same(receiver.unpack(t3), small)
    finally:
        sender.close()
        receiver.close()


def test_inherited_ring_is_enlarged_in_place_once_its_tickets_are_consumed():
    fds = worker_fds(1)
    sender = RingSender(slots=2, worker_id=0, fd_spec=fds[0])
    receiver = RingReceiver(fds)
    try:
        small, big = [b"s" * 100], [b"b" * (3 << 20)]
        t1 = _cross(sender.pack(small))
        assert t1.ring == (0, 0) and t1.fd is None  # nothing to hand over: inherited
        assert sender.pack(big) is big  # t1 not consumed yet: cannot re-layout, stock path
        assert_same(receiver.unpack(t1), small)
        t2 = _cross(sender.pack(big))
        assert t2.ring == (0, 0) and t2.ring_bytes > t1.ring_bytes
        t3 = _cross(sender.pack(small))
        assert_same(receiver.unpack(t2), big)
        assert_same(receiver.unpack(t3), small)
    finally:
        sender.close()
        receiver.close()
    assert receiver._fds == []


def test_unpicklable_batch_raises_in_the_worker_with_the_cause():
    sender = RingSender(slots=2)
    try:
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            sender.pack([lambda: 0])
        assert isinstance(sender.pack([b"ok"]), Ticket)  # the sender is still usable
    finally:
        sender.close()


def test_unknown_ring_is_a_clear_error():
    sender, receiver = RingSender(slots=2), RingReceiver()
    try:
        _cross(sender.pack([b"first"]))  # first ticket (with the fd) lost
        with pytest.raises(RuntimeError, match="never received"):
            receiver.unpack(_cross(sender.pack([b"second"])))
    finally:
        sender.close()


def _rich_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "keys": [s["__key__"] for s in samples],
        "bin": [s["bin"] for s in samples],
        "raw": bytearray(b"".join(s["cls"] for s in samples)),
        "lens": np.array([len(s["bin"]) for s in samples], dtype=np.int32),
        "pairs": [Pair(s["__key__"], None) for s in samples],
    }


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_workers=2),
        dict(num_workers=3, prefetch_factor=1),
        dict(num_workers=2, persistent_workers=True, prefetch_factor=4),
        dict(num_workers=2, pin_memory=True),  # transport off, torch pins
    ],
)
def test_loader_delivers_the_same_batches_and_state_with_the_ring(stream_data, kw, monkeypatch):
    tickets = []
    unpack = RingReceiver.unpack

    def counting(self: RingReceiver, item: Any) -> Any:
        tickets.append(isinstance(item, Ticket))
        return unpack(self, item)

    monkeypatch.setattr(RingReceiver, "unpack", counting)
    ds = StreamingDataset(stream_data("tar"), seed=5)
    ref = StatefulLoader(ds, 16, collate_fn=_rich_collate, shm_transport=False)
    ld = StatefulLoader(ds, 16, collate_fn=_rich_collate, **kw)
    for _epoch in range(2):  # persistent workers keep their ring across epochs
        n = 0
        for g, w in zip(ld, ref, strict=True):
            assert_same(g, w)
            assert ld.state_dict() == ref.state_dict()  # counts delivered batches alike
            n += 1
        assert n == len(ld) > 10
        assert ld.state_dict() == ref.state_dict()
    # every batch of `ld` took the ring (`ref`, without workers, hands over plain batches),
    # except with pin_memory: then torch's pin thread pins them in the background
    assert len(tickets) == 4 * n
    assert sum(tickets) == (0 if kw.get("pin_memory") else 2 * n)


def test_spawned_workers_receive_their_ring_fd_too(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=7)
    ref = StatefulLoader(ds, 32, collate_fn=_rich_collate, shm_transport=False)
    ld = StatefulLoader(
        ds, 32, collate_fn=_rich_collate, num_workers=1, multiprocessing_context="spawn"
    )
    for g, w in zip(ld, ref, strict=True):
        assert_same(g, w)


def _tensor_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {**_rich_collate(samples), "t": torch.tensor([len(s["bin"]) for s in samples])}


def test_loader_with_tensor_batches_matches_stock(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=8)
    ref = StatefulLoader(ds, 16, collate_fn=_tensor_collate, shm_transport=False)
    ld = StatefulLoader(ds, 16, collate_fn=_tensor_collate, num_workers=2)
    for g, w in zip(ld, ref, strict=True):
        assert_same(g, w)


def test_state_and_resume_count_ring_batches_like_stock_ones(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=6)
    ld = StatefulLoader(ds, 8, collate_fn=_rich_collate, num_workers=2)
    it = iter(ld)
    first = [next(it) for _ in range(5)]
    sd = ld.state_dict()
    assert sd["samples_consumed"] == 40
    rest_here = [b["keys"] for b in it]
    fresh = StatefulLoader(ds, 8, collate_fn=_rich_collate, num_workers=2)
    fresh.load_state_dict(sd)
    assert [b["keys"] for b in fresh] == rest_here
    assert sum(len(b["keys"]) for b in first) + sum(map(len, rest_here)) >= ds.epoch_length
