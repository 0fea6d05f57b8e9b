"""The tests' own rendezvous leave no port for another process to take (task "ports": a
full-suite run under 3 xdist workers failed ``test_memtier_ranks.py`` with EADDRINUSE on the
``MASTER_PORT`` that ``free_port()`` had picked and another process took before rank 0
bound it). The race made deterministic: the port is taken before the ranks start."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from rankkit import group_file, join_group, reserved_port
from unbroken.elastic.rendezvous import Coordinator, free_port

_IP_LOCAL_PORT_RANGE = 51  # linux/in.h (Linux >= 6.3): this socket's ephemeral port range


def _rank(rank: int, rdzv: str) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    join_group(rank, 2, rdzv)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.all_reduce(t, group=dist.new_group(backend="gloo"))  # what Checkpointer makes
    dist.destroy_process_group()
    os._exit(0 if float(t) == 6.0 else 3)


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process holds (listening), as in the failed run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_ranks_meet_while_the_master_port_is_taken(tmp_path, monkeypatch, taken: int) -> None:
    """Task "ports" item 3: with ``MASTER_PORT`` taken, rank 0 of an ``env://`` group
    cannot host its store (the failed run's error); ranks that meet through
    :func:`rankkit.join_group` do not use it."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(taken))
    with pytest.raises(dist.DistNetworkError, match="EADDRINUSE"):
        TCPStore("127.0.0.1", taken, is_master=True, wait_for_workers=False)  # env:// rank 0
    rdzv = group_file(str(tmp_path))
    procs = [mp.get_context("fork").Process(target=_rank, args=(r, rdzv)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert codes == [0, 0], codes


def _only_port(port: int) -> socket.socket:
    """A socket whose ephemeral port (``connect``, ``bind`` to 0) can only be ``port``."""
    s = socket.socket()
    try:
        s.setsockopt(socket.IPPROTO_IP, _IP_LOCAL_PORT_RANGE, struct.pack("I", port | port << 16))
    except OSError as e:
        s.close()
        pytest.skip(f"IP_LOCAL_PORT_RANGE (Linux >= 6.3) unavailable: {e}")
    return s


def _goes_to_no_other_socket(port: int, taken: int) -> None:
    """Neither a ``connect`` nor a ``bind`` to port 0 (on any address) gets ``port``."""
    with _only_port(port) as other, pytest.raises(OSError) as e:
        other.connect(("127.0.0.1", taken))
    assert e.value.errno == errno.EADDRNOTAVAIL
    for addr in ("127.0.0.1", ""):
        with _only_port(port) as other, pytest.raises(OSError) as e:
            other.bind((addr, 0))
        assert e.value.errno == errno.EADDRINUSE


def test_a_reserved_port_goes_to_no_other_socket_but_its_server(taken: int) -> None:
    """Task "ports" item 2: a port from ``free_port()`` goes to the next ``connect`` that
    the kernel lets have it, and the supervisor then cannot host its store there; a port
    from :func:`rankkit.reserved_port` goes neither to a ``connect`` nor to a ``bind`` to
    port 0, and the supervisor hosts its store on it."""
    picked = free_port()
    with _only_port(picked) as other:
        other.connect(("127.0.0.1", taken))  # another test's gloo connection, say
        assert other.getsockname()[1] == picked
        with pytest.raises(RuntimeError, match="cannot reach the rendezvous store"):
            Coordinator("127.0.0.1", picked, "ports", "A", connect_timeout=1.0)

    with reserved_port() as port:
        _goes_to_no_other_socket(port, taken)
        coord = Coordinator("127.0.0.1", port, "ports", "A", connect_timeout=5.0)
        assert (coord.hosting, coord.port) == (True, port)
        joined = Coordinator("127.0.0.1", port, "ports", "B", connect_timeout=5.0)
        assert not joined.hosting and set(coord.peers()) == {"B"}


def test_the_agent_holds_rank_0s_master_port_until_its_worker_hosts_the_store(taken: int) -> None:
    """The workers' ``MASTER_PORT`` under ``unbroken run`` (torch's agent-shared store is off,
    see ``attempt_env``): rank 0's agent picks it and publishes it, and rank 0's worker binds
    it seconds later. torch's ``get_free_port()`` closes it in between, and another process
    took it (three node-loss drills on one box: EADDRINUSE in ``init_process_group``). The
    agent of ``unbroken run`` (:mod:`unbroken.elastic.launch.agent`) keeps it bound until the
    next round picks another: no ``connect`` and no ``bind`` to port 0 gets it, and the
    worker's store (``env://`` rank 0) is hosted on it."""
    from torch.distributed.elastic.rendezvous import api

    from unbroken.elastic.launch import agent

    agent.hold_master_port()
    agent.hold_master_port()  # twice is once
    info = api.RendezvousStoreInfo.build(0, dist.HashStore(), local_addr="127.0.0.1")
    port = info.master_port
    _goes_to_no_other_socket(port, taken)
    with pytest.raises(ConnectionRefusedError):  # held, not served: nothing to talk to there
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set("k", "v")
    assert TCPStore("127.0.0.1", port, is_master=False).get("k") == b"v"
    # the next round (a restart) holds a new port and lets the old one go
    nxt = api.RendezvousStoreInfo.build(0, dist.HashStore(), local_addr="127.0.0.1").master_port
    assert nxt != port
    del store
    with _only_port(port) as other:
        other.bind(("127.0.0.1", 0))
        assert other.getsockname()[1] == port


def test_where_no_port_can_be_held_the_agent_takes_torchs_free_port(monkeypatch) -> None:
    """A host where no IPv4 socket binds (IPv6 only; not this box, so its bind is made to
    fail): the rendezvous still gets a port, torch's own, held by nobody as before."""
    from torch.distributed.elastic.rendezvous import api

    from unbroken.elastic.launch import agent

    class NoIPv4(socket.socket):
        def bind(self, address: Any) -> None:
            if address == ("", 0):  # the hold's bind; torch's ("localhost", 0) goes through
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            super().bind(address)

    agent.hold_master_port()
    for held in agent._held:  # what an earlier test held: let go, as a new round would
        held.close()
    agent._held.clear()
    monkeypatch.setattr(agent.socket, "socket", NoIPv4)
    port = api.get_free_port()
    monkeypatch.undo()
    assert 0 < port < 65536 and not agent._held
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # not held: torch's port, free once it returned
