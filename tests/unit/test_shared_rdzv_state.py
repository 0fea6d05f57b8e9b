"""torchrun's rendezvous state, read back from a store anyone on the node can write, is
loaded by ``unbroken run``'s agents without running code (README, "Security model: a shared
node"). A real TCPStore and torch's own dynamic rendezvous handler write the state."""

from __future__ import annotations

import base64
import datetime
import os
import pickle
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from unbroken.elastic.launch import agent


class _Mkdir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (self.path,)


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setattr(dr, "pickle", dr.pickle)  # put back whatever it was after the test
    assert agent.guard_rendezvous_state() and agent.guard_rendezvous_state()  # idempotent


def _handler(store: TCPStore, run_id: str) -> dr.DynamicRendezvousHandler:
    backend = C10dRendezvousBackend(store, run_id)
    return dr.DynamicRendezvousHandler.from_backend(
        run_id, store, backend, min_nodes=1, max_nodes=1, local_addr="127.0.0.1"
    )


def _store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))


def test_torchruns_own_state_is_accepted(guarded):
    """A rendezvous torch itself runs (join, keep-alive, state with UTC times) goes through."""
    store = _store()
    h = _handler(store, "own")
    h.next_rendezvous()
    raw = base64.b64decode(store.get("torch.rendezvous.own"))
    state = agent._load_state(raw)
    assert len(state.participants) == 1 and state.last_heartbeats
    h._state_holder.sync()  # what each join, keep-alive and membership poll calls
    h.shutdown()


def test_a_planted_pickle_is_refused_and_runs_nothing(guarded, tmp_path):
    """A stranger's pickle in the key: its callable never runs; torch's handler raises its
    own RendezvousStateError carrying why (the agent fails, not the stranger's code runs)."""
    store = _store()
    marker = str(tmp_path / "ran")
    h = _handler(store, "planted")
    h.next_rendezvous()
    state = agent._load_state(base64.b64decode(store.get("torch.rendezvous.planted")))
    store.set("torch.rendezvous.planted", base64.b64encode(pickle.dumps(_Mkdir(marker))).decode())
    deadline = time.monotonic() + 10.0  # the handler serves a cached state for 1 s
    with pytest.raises(RendezvousStateError) as e:
        while time.monotonic() < deadline:
            h.num_nodes_waiting()  # torchrun's membership poll: a sync of the state
            time.sleep(0.02)
    assert not os.path.exists(marker)
    assert "refused" in str(e.value.__cause__) and "posix.mkdir" in str(e.value.__cause__)
    # a state torch accepts again, so that shutdown() can stop the keep-alive thread
    store.set("torch.rendezvous.planted", base64.b64encode(pickle.dumps(state)).decode())
    h.shutdown()


@pytest.mark.parametrize(
    "bad",
    [
        pickle.dumps(5),
        b"\x80\x04garbage",
        pickle.dumps(datetime.datetime.now()),
        pickle.dumps({"round": 0}),
    ],
    ids=["int", "garbage", "datetime", "dict"],
)
def test_what_is_not_a_rendezvous_state_is_refused(bad):
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        agent._load_state(bad)


def test_a_state_of_the_right_class_with_wrong_fields_is_refused():
    """Right classes, wrong shapes (torch's code would fail deep inside on them)."""
    good = dr._RendezvousState()
    node = dr._NodeDesc("127.0.0.1", 1, 0)
    good.participants[node] = 0
    good.last_heartbeats[node] = datetime.datetime.now(datetime.timezone.utc)
    assert agent._load_state(pickle.dumps(good)).participants == {node: 0}
    for field, value in [
        ("round", "1"),
        ("closed", 1),
        ("participants", [node]),
        ("wait_list", {"a"}),
        ("last_heartbeats", {node: 1.0}),
        ("extra", 1),
    ]:
        s = pickle.loads(pickle.dumps(good))
        setattr(s, field, value)
        with pytest.raises(pickle.UnpicklingError, match="fields"):
            agent._load_state(pickle.dumps(s))
    odd = dr._NodeDesc(7, 1, 0)  # type: ignore[arg-type]
    s = pickle.loads(pickle.dumps(good))
    s.participants = {odd: 0}
    with pytest.raises(pickle.UnpicklingError, match="fields"):
        agent._load_state(pickle.dumps(s))
