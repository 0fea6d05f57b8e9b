"""The worker -> main batch transport (shared-memory rings): exact round trips of every kind
of batch, tensors collated straight into a slot and wrapped without a copy, slots recycled
only when nothing views them any more, the per-batch choice of pipe or ring, fall-backs, and
the StatefulLoader delivering the same batches and state with and without it."""

from __future__ import annotations

import gc
import json
import pickle
from collections import OrderedDict, namedtuple
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from unbroken.common.procs import maps_address
from unbroken.data.stream import transport as _transport
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.stream.loader import StatefulLoader
from unbroken.data.stream.transport import (
    RingReceiver,
    RingSender,
    Ticket,
    transport_available,
    worker_fds,
)

pytestmark = [
    pytest.mark.skipif(not transport_available(), reason="needs os.memfd_create (Linux)"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
]

Pair = namedtuple("Pair", "a b")


def assert_same(got: Any, want: Any, path: str = "batch") -> None:
    """Equal values *and* identical types, all the way down (tensors: dtype, shape, strides)."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.stride() == want.stride(), path
        assert torch.equal(got, want), path
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


@pytest.fixture
def ring() -> Any:
    """A sender on an inherited ring and its receiver, as a forked worker and the loader."""
    fds = worker_fds(1, 64 << 20)
    sender, receiver = RingSender(worker_id=0, fd_spec=fds[0]), RingReceiver(fds)
    yield sender, receiver
    sender.close()
    receiver.close()


def _in_ring(t: torch.Tensor, receiver: RingReceiver) -> bool:
    mm = receiver._rings[(0, 0)].mm
    start = np.frombuffer(mm, np.uint8, 1).ctypes.data
    return start <= t.data_ptr() < start + len(mm)


def _batches() -> list[Any]:
    rng = np.random.default_rng(0)
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return [
        [(f"{i:08d}", rng.bytes(4096)) for i in range(256)],  # raw payloads (~1 MB)
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
        [b"\xff" * (3 << 20)],  # bigger than the slots so far: a larger slot is made
        # tensors: every dtype family, 0-d, empty, non-contiguous, views sharing a storage
        {"x": x, "t": x.t(), "row": x[1], "tail": x[:, 2:], "lbl": torch.tensor([1, 2])},
        [torch.tensor(3.5), torch.empty(0, 7), torch.zeros(2, 0, dtype=torch.int64)],
        [
            torch.arange(10).to(d)
            for d in (
                torch.uint8,
                torch.int8,
                torch.int16,
                torch.int32,
                torch.int64,
                torch.float16,
                torch.bfloat16,
                torch.float64,
                torch.complex64,
            )
        ],
        {"mask": torch.tensor([True, False, True]), "p": Pair(torch.ones(3), "k")},
        torch.randn(256, 3, 32, 32),  # a plain tensor batch
        ["small", 1, b"s"],
    ]


def test_round_trip_gives_identical_objects(ring):
    sender, receiver = ring
    for want in _batches():
        shipped = sender.pack(want)
        assert isinstance(shipped, Ticket), want if not isinstance(want, list) else len(want)
        sender._pipe_left = 0  # every batch through the ring here, small ones too
        assert_same(receiver.unpack(_cross(shipped)), want)


def test_views_of_one_storage_still_share_it_after_the_trip(ring):
    sender, receiver = ring
    x = torch.arange(12.0)
    got = receiver.unpack(_cross(sender.pack({"a": x[:6], "b": x[3:]})))
    got["a"][4] = -1.0  # position 4 of x is position 1 of b
    assert got["b"][1] == -1.0
    assert x[4] == 4.0  # and the sender's tensor is not the receiver's


def test_default_collate_stacks_into_the_slot_and_the_batch_arrives_without_a_copy(ring):
    sender, receiver = ring
    rng = np.random.default_rng(1)

    def sample(i: int) -> dict[str, Any]:
        return {
            "x": torch.from_numpy(rng.random(512, dtype=np.float32)),
            "img": rng.integers(0, 255, (3, 16, 16), dtype=np.uint8),  # numpy: as_tensor, stack
            "label": i % 7,
            "w": 0.25 * i,
            "flag": i % 3 == 0,  # bools: torch.tensor's bool tensor
            "mixed": i if i % 2 else 0.5,  # ints and floats: float64, as default_collate
            "key": f"k{i}",
            "pair": Pair(i, torch.tensor([i, -i])),
        }

    for b in range(6):
        samples = [sample(b * 64 + i) for i in range(64)]
        ticket = sender.collate(samples, default_collate)
        assert isinstance(ticket, Ticket)
        got = receiver.unpack(_cross(ticket))
        assert_same(got, default_collate(samples))
        assert _in_ring(got["x"], receiver) and _in_ring(got["img"], receiver)
        if b:  # from the second batch on, the slot is sized and the stack lands in it
            assert sender._slots[ticket.slot].size >= 64 * 512 * 4


def test_a_slot_is_reused_only_after_every_view_of_its_batch_is_gone(ring):
    sender, receiver = ring

    def send(v: float) -> torch.Tensor:
        b = {"x": torch.full((64, 256), v), "y": torch.tensor([v])}
        return receiver.unpack(
            _cross(sender.collate([b["x"][i] for i in range(64)], default_collate))
        )

    first = send(1.0)
    kept = first[5:7]  # a slice of the first batch, kept by the "training loop"
    del first
    gc.collect()
    for v in range(2, 40):
        send(float(v))  # dropped right away: its slot is free again at once
    assert torch.equal(kept, torch.full((2, 256), 1.0))  # never overwritten
    assert len(sender._slots) <= 3  # one held by `kept`, the others recycled
    del kept
    gc.collect()
    held = [send(float(v)) for v in range(3)]
    assert all(torch.equal(h, torch.full((64, 256), float(v))) for v, h in enumerate(held))
    assert len(sender._slots) <= 3


def test_small_tensors_a_loop_keeps_do_not_hold_their_batchs_slot(ring):
    """A loop that keeps each batch's labels or ids (for epoch metrics) must not hold the
    slots: they were the 64 slots' owners after 64 batches, and every later batch took torch's
    stock path (measured: 2x the workers' CPU and half the samples/s in
    ``benchmarks/data_remote.py``, whose loop keeps ``batch["i"]``). Small storages arrive as
    copies, the large ones as views of the slot; views of one storage still share it."""
    sender, receiver = ring
    kept = []
    for v in range(200):
        samples = [{"x": torch.full((1000,), float(v)), "i": v * 100 + k} for k in range(64)]
        t = sender.collate(samples, default_collate)
        assert isinstance(t, Ticket), v  # never the stock path
        b = receiver.unpack(_cross(t))
        assert _in_ring(b["x"], receiver) and not _in_ring(b["i"], receiver)
        kept.append(b["i"])
        del b, t
    assert len(sender._slots) <= 2  # the big tensors are dropped: their slots recycled
    for v, i in enumerate(kept):
        assert torch.equal(i, torch.arange(64) + v * 100)
    small = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    got = receiver.unpack(_cross(sender.pack({"x": small, "t": small.t(), "tail": small[:, 2:]})))
    assert not _in_ring(got["x"], receiver)
    assert got["t"].untyped_storage().data_ptr() == got["x"].untyped_storage().data_ptr()
    got["x"][0, 3] = -1.0
    assert got["tail"][0, 1] == -1.0 and got["t"][3, 0] == -1.0
    assert not receiver._rings[(0, 0)].refs  # nothing views the slot: released at once
    edge = {
        "at": torch.zeros(2048, dtype=torch.int64),
        "over": torch.zeros(2049, dtype=torch.int64),
    }
    got = receiver.unpack(_cross(sender.pack(edge)))  # 16 KiB: a copy; 8 bytes more: a view
    assert not _in_ring(got["at"], receiver) and _in_ring(got["over"], receiver)


def test_a_ring_whose_slots_are_all_held_says_so_once(caplog):
    fds = worker_fds(1, 16 << 20)
    sender = RingSender(max_slots=2, worker_id=0, fd_spec=fds[0])
    receiver = RingReceiver(fds)
    try:
        rows = [torch.full((1000,), float(i)) for i in range(8)]
        held = [receiver.unpack(_cross(sender.collate(rows, default_collate))) for _ in range(2)]
        with caplog.at_level("WARNING", logger=_transport.__name__):
            for _ in range(3):
                assert isinstance(sender.collate(rows, default_collate), torch.Tensor)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1, said
        assert "2 slots" in said[0] and "clone()" in said[0], said[0]
        assert all(torch.equal(h, torch.stack(rows)) for h in held)
    finally:
        sender.close()
        receiver.close()


def test_all_slots_held_falls_back_to_the_stock_path_instead_of_waiting():
    fds = worker_fds(1, 16 << 20)
    sender = RingSender(max_slots=2, worker_id=0, fd_spec=fds[0])
    receiver = RingReceiver(fds)
    try:
        rows = [torch.full((1000,), float(i)) for i in range(8)]
        a = receiver.unpack(_cross(sender.collate(rows, default_collate)))
        b = receiver.unpack(_cross(sender.collate(rows, default_collate)))
        c = sender.collate(rows, default_collate)  # both slots held by a and b
        assert isinstance(c, torch.Tensor) and not _in_ring(c, receiver)
        assert_same(c, torch.stack(rows))
        del a
        gc.collect()
        d = sender.collate(rows, default_collate)  # a's slot is free again
        assert isinstance(d, Ticket)
        assert_same(receiver.unpack(_cross(d)), torch.stack(rows))
        assert_same(b, torch.stack(rows))
    finally:
        sender.close()
        receiver.close()


def test_small_tensor_free_batches_take_the_pipe_and_the_ring_is_probed_again(ring):
    sender, receiver = ring
    small = list(range(64))
    first = sender.pack(small)
    assert isinstance(first, Ticket)  # measured through the ring once...
    assert_same(receiver.unpack(_cross(first)), small)
    piped = [sender.pack(small) for _ in range(_transport._PROBE - 1)]
    assert all(p is small for p in piped)  # ...then the pipe, which is cheaper for these
    assert isinstance(sender.pack(small), Ticket)  # the probe
    big = [bytes([i]) * 4096 for i in range(64)]  # 256 KB: the ring again, and it stays
    sender._pipe_left = 0
    assert isinstance(sender.pack(big), Ticket) and isinstance(sender.pack(big), Ticket)
    tensors = {"t": torch.zeros(4)}  # any tensor takes the ring: the pipe would pass an fd
    assert isinstance(sender.pack(tensors), Ticket)


def test_a_batch_larger_than_the_ring_takes_the_stock_path():
    fds = worker_fds(1, 4 << 20)
    sender, receiver = RingSender(worker_id=0, fd_spec=fds[0]), RingReceiver(fds)
    try:
        big = [b"y" * (5 << 20)]
        assert sender.pack(big) is big
        mid = {"t": torch.ones(1 << 18)}  # 1 MiB: fits
        assert_same(receiver.unpack(_cross(sender.pack(mid))), mid)
    finally:
        sender.close()
        receiver.close()


def test_a_collated_batch_that_falls_back_leaves_the_slot_first():
    """Tensors stacked into a slot, then the pickle does not fit and no larger slot can be
    made: the batch takes the stock path with its tensors copied out of the slot (the queue
    pickles it later, when the slot may be written again)."""
    fds = worker_fds(1, 1 << 20)
    sender, receiver = RingSender(worker_id=0, fd_spec=fds[0]), RingReceiver(fds)
    try:
        small = [{"x": torch.ones(16), "b": b""} for _ in range(4)]
        receiver.unpack(_cross(sender.collate(small, default_collate)))  # sizes the slot
        big = [{"x": torch.ones(16), "b": b"z" * (300 << 10)} for _ in range(4)]
        out = sender.collate(big, default_collate)
        assert isinstance(out, dict) and not _in_ring(out["x"], receiver)
        assert_same(out, default_collate(big))
    finally:
        sender.close()
        receiver.close()


def test_objects_passed_as_file_descriptors_keep_torchs_path(ring):
    sender, _ = ring
    for odd in ([torch.ones(2).untyped_storage()], {"g": torch.ones(2, requires_grad=True)}):
        s = RingSender()
        try:
            assert s.pack(odd) is odd
            later = [b"y" * 100_000]
            assert s.pack(later) is later  # the stream's batches are alike: stays off
        finally:
            s.close()


def test_unpicklable_batch_raises_in_the_worker_with_the_cause(ring):
    sender, _ = ring
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        sender.pack([lambda: 0])
    assert isinstance(sender.pack([b"ok" * 20_000]), Ticket)  # the sender is still usable


def test_own_ring_is_sent_once_and_an_unknown_ring_is_a_clear_error():
    sender, receiver = RingSender(), RingReceiver()  # no inherited fd: spawn's case
    try:
        first = _cross(sender.pack([b"a" * 40_000]))
        assert first.fd is not None and first.ring[0] != 0
        assert_same(receiver.unpack(first), [b"a" * 40_000])
        second = _cross(sender.pack([b"b" * 40_000]))
        assert second.fd is None
        assert_same(receiver.unpack(second), [b"b" * 40_000])
        with pytest.raises(RuntimeError, match="never received"):
            RingReceiver().unpack(_cross(sender.pack([b"c" * 40_000])))
    finally:
        sender.close()
        receiver.close()


def test_receiver_close_leaves_live_batches_valid(ring):
    sender, receiver = ring
    got = receiver.unpack(_cross(sender.pack({"t": torch.arange(100)})))
    receiver.close()  # the loader's iteration ended; the training loop still holds a batch
    assert torch.equal(got["t"], torch.arange(100))
    assert receiver._fds == []


# --- through the StatefulLoader -----------------------------------------------------------


def _rich_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "keys": [s["__key__"] for s in samples],
        "bin": [s["bin"] for s in samples],
        "raw": bytearray(b"".join(s["cls"] for s in samples)),
        "lens": np.array([len(s["bin"]) for s in samples], dtype=np.int32),
        "pairs": [Pair(s["__key__"], None) for s in samples],
    }


def decode(s: dict[str, Any]) -> dict[str, Any]:
    """The README's path: decode in the worker, tensors and numbers out."""
    return {
        "x": torch.from_numpy(np.frombuffer(s["bin"], np.uint8, 256).astype(np.float32)),
        "cls": int(s["cls"]),
        "key": s["__key__"],
    }


def _decoded_list(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list(samples)  # a custom collate: one tensor per sample, copied into the slot


def _count_tickets(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    tickets: list[bool] = []
    unpack = RingReceiver.unpack

    def counting(self: RingReceiver, item: Any) -> Any:
        tickets.append(isinstance(item, Ticket))
        return unpack(self, item)

    monkeypatch.setattr(RingReceiver, "unpack", counting)
    return tickets


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_workers=2),
        dict(num_workers=3, prefetch_factor=1),
        dict(num_workers=2, persistent_workers=True, prefetch_factor=4),
        dict(num_workers=2, pin_memory=True),  # no CUDA here: nothing to pin, ring on
    ],
)
def test_loader_delivers_the_same_batches_and_state_with_the_ring(stream_data, kw, monkeypatch):
    tickets = _count_tickets(monkeypatch)
    ds = StreamingDataset(stream_data("tar"), seed=5)
    ref = StatefulLoader(ds, batch_size=16, collate_fn=_rich_collate, shm_transport=False)
    ld = StatefulLoader(ds, batch_size=16, collate_fn=_rich_collate, **kw)
    for _epoch in range(2):  # persistent workers keep their ring across epochs
        n = 0
        for g, w in zip(ld, ref, strict=True):
            assert_same(g, w)
            assert ld.state_dict() == ref.state_dict()  # counts delivered batches alike
            n += 1
        assert n == len(ld) > 10
        assert ld.state_dict() == ref.state_dict()
    # Batch 0 of a run is made in this process while the workers start (persistent workers
    # run the second epoch whole); every worker's batch (~10 KB of bytes) takes the ring.
    persistent = kw.get("persistent_workers", False)
    from_workers = 2 * n - 1 if persistent else 2 * (n - 1)
    assert len(tickets) == 2 * n + from_workers and sum(tickets) == from_workers


@pytest.mark.parametrize("collate", [None, _decoded_list])
def test_decoded_tensor_batches_take_the_ring_and_match_stock(stream_data, collate, monkeypatch):
    tickets = _count_tickets(monkeypatch)
    ds = StreamingDataset(stream_data("tar"), seed=8, transform=decode)
    ref = StatefulLoader(ds, batch_size=16, collate_fn=collate, shm_transport=False)
    ld = StatefulLoader(ds, batch_size=16, collate_fn=collate, num_workers=2)
    kept = []
    n = 0
    for g, w in zip(ld, ref, strict=True):
        assert_same(g, w)
        if n % 3 == 0:
            kept.append((g, w))  # held by the loop: their slots must not be reused
        n += 1
    for g, w in kept:
        assert_same(g, w)
    assert n > 10 and sum(tickets) == n - 1 == len(tickets) - n  # batch 0: made here


def test_token_batches_arrive_as_tensors_in_the_ring(stream_data, monkeypatch):
    tickets = _count_tickets(monkeypatch)
    ds = StreamingDataset(stream_data("tokens"), seed=2)
    ref = list(StatefulLoader(ds, batch_size=4))
    got = []
    for b in StatefulLoader(ds, batch_size=4, num_workers=2):
        assert b.dtype == torch.int64 and b.shape == (4, 9)
        got.append(b)
    assert len(got) == len(ref)
    for g, w in zip(got, ref, strict=True):
        assert_same(g, w)
    assert sum(tickets) == len(got) - 1  # the workers' batches (0 is made here), no pipe


@pytest.mark.slow  # issue 24 item 10: out of `make unit`, still in `make test`
def test_spawned_workers_send_their_ring_fd_once(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=7, transform=decode)
    ref = StatefulLoader(ds, batch_size=32, shm_transport=False)
    ld = StatefulLoader(ds, batch_size=32, num_workers=1, multiprocessing_context="spawn")
    for g, w in zip(ld, ref, strict=True):
        assert_same(g, w)


def _init_worker(wid: int) -> None:
    pass


@pytest.mark.parametrize("kw", [{}, {"worker_init_fn": _init_worker}])
def test_the_first_batch_of_a_run_is_made_here_unless_workers_need_their_init(
    stream_data, kw, monkeypatch
):
    tickets = _count_tickets(monkeypatch)
    ds = StreamingDataset(stream_data("tar"), seed=4, transform=decode)
    ref = [b["key"] for b in StatefulLoader(ds, batch_size=16)]
    ld = StatefulLoader(ds, batch_size=16, num_workers=2, **kw)
    assert [b["key"] for b in ld] == ref
    made_here = 0 if kw else 1
    assert len(tickets) == 2 * len(ref) - made_here and sum(tickets) == len(ref) - made_here
    # a resume that leaves one batch: made here, no worker started at all
    sd = ld.state_dict()
    sd.update(epoch=0, samples_consumed=ds.epoch_length - 5)
    alone = StatefulLoader(ds, batch_size=16)
    alone.load_state_dict(sd)
    want = [b["key"] for b in alone]
    ld.load_state_dict(sd)
    tickets.clear()
    assert len(want) == 1 and [b["key"] for b in ld] == want
    assert tickets == ([True] if kw else [])  # the worker's tensor batch: through the ring


def test_state_and_resume_count_ring_batches_like_stock_ones(stream_data):
    ds = StreamingDataset(stream_data("tar"), seed=6, transform=decode)
    ld = StatefulLoader(ds, batch_size=8, num_workers=2)
    it = iter(ld)
    first = [next(it) for _ in range(5)]
    sd = ld.state_dict()
    assert sd["samples_consumed"] == 40
    rest_here = [b["key"] for b in it]
    fresh = StatefulLoader(ds, batch_size=8, num_workers=2)
    fresh.load_state_dict(json.loads(json.dumps(sd)))
    assert [b["key"] for b in fresh] == rest_here
    assert sum(len(b["key"]) for b in first) + sum(map(len, rest_here)) >= ds.epoch_length


class _FakeCuda:
    """The CUDA calls of the pinned path, recorded (CI has no GPU; benchmarks/gpu_checks.py
    runs the real ones): registrations, and events whose completion the test decides."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.events_done = False
        fake = self

        class Event:
            def record(self, stream: Any = None) -> None:
                pass

            def query(self) -> bool:
                return fake.events_done

        self.Event = Event

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        assert ptr % 4096 == 0 and size % 4096 == 0 and flags == 1
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_pinned_slots_are_registered_once_and_reused_only_after_the_copy_event(monkeypatch):
    cuda = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "check_error", lambda res: None if res == 0 else 1 / 0)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    fds = worker_fds(1, 16 << 20)
    sender, receiver = RingSender(worker_id=0, fd_spec=fds[0]), RingReceiver(fds, pin=True)
    assert receiver.pin
    rows = [torch.full((1000,), float(i)) for i in range(8)]

    def send() -> tuple[Ticket, torch.Tensor]:
        t = _cross(sender.collate(rows, default_collate))
        return t, receiver.unpack(t)

    t1, b1 = send()
    assert len(cuda.registered) == 1
    t2, b2 = send()
    assert t2.slot != t1.slot and len(cuda.registered) == 2  # b1 alive: another slot
    del b1
    gc.collect()  # b1 is gone, but a non-blocking copy from it may still be running
    t3, b3 = send()  # the receiver records an event for b1's slot; not done yet
    assert t3.slot not in (t1.slot, t2.slot)
    cuda.events_done = True
    del b3
    gc.collect()
    t4, b4 = send()  # packed before this unpack reaps: a new slot; the reap frees b1's, b3's
    t5, b5 = send()
    t6, b6 = send()
    assert {t5.slot, t6.slot} == {t1.slot, t3.slot} and len(cuda.registered) == 4
    assert all(torch.equal(b, torch.stack(rows)) for b in (b2, b4, b5, b6))
    receiver.close()
    assert cuda.unregistered == []  # batches b2, b4, b5, b6 still view their slots
    del b2, b4, b5, b6
    gc.collect()
    receiver2 = RingReceiver(None, pin=True)
    receiver2.unpack(None)  # the next loader's batches finish what the last one left
    assert sorted(cuda.unregistered) == sorted(cuda.registered)
    assert not _transport._PINNED.dead and not _transport._PINNED.waiting
    sender.close()


def test_a_receiver_dropped_without_close_ends_each_registration_before_its_memory_goes(
    monkeypatch,
):
    """A persistent loader collected mid-epoch drops its receiver unclosed. CUDA keeps a
    registration over memory that is unmapped under it, and a later pinned allocation at
    that address fails ("resource already mapped": seen on the H200 in gpu_checks.py, the
    feed check after the ring check). So the registration ends first - after a synchronize,
    since a copy from the slot may still be queued - and then the memory is unmapped."""
    cuda = _FakeCuda()
    seen: list[tuple[str, int, bool]] = []
    unregister = cuda.cudaHostUnregister

    def recording_unregister(ptr: int) -> int:
        seen.append(("unregister", ptr, maps_address(ptr)))
        return unregister(ptr)

    cuda.cudaHostUnregister = recording_unregister  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "check_error", lambda res: None if res == 0 else 1 / 0)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: seen.append(("sync", d, True)))
    fds = worker_fds(1, 16 << 20)
    sender, receiver = RingSender(worker_id=0, fd_spec=fds[0]), RingReceiver(fds, pin=True)
    rows = [torch.full((1000,), float(i)) for i in range(8)]
    batches = [receiver.unpack(_cross(sender.collate(rows, default_collate))) for _ in range(2)]
    assert len(cuda.registered) == 2
    del batches
    gc.collect()  # the batches' slots wait for their copy events (never done here)
    del receiver  # no close(): what a collected persistent loader does
    gc.collect()
    assert seen == []  # the pending releases still hold the ring
    cuda.events_done = True
    RingReceiver(None, pin=True).unpack(None)  # the next loader's reap lets the ring go
    gc.collect()
    assert seen[:2] == [("sync", 0, True), ("sync", 1, True)]  # every device, first
    assert sorted(p for what, p, _ in seen if what == "unregister") == sorted(cuda.registered)
    assert all(mapped for _, _, mapped in seen), seen
    assert not any(maps_address(p) for p in cuda.registered)  # and then it is unmapped
    sender.close()
