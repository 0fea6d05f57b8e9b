"""The supervisors' rendezvous store (``Coordinator``): where it listens, and what it makes of
values that anyone who can reach the store may have written (issue 20 item 3).

Real TCPStores on 127.0.0.1: the hosting Coordinator and a stranger's client."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from unbroken.elastic.rendezvous import Coordinator

pytestmark = pytest.mark.timeout(60)


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of sockets listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, _remote, state = line.split()[1:4]
                addr, _, p = local.rpartition(":")
                if state == "0A" and int(p, 16) == port:
                    out.append(addr)
    return out


def _coord(node: str = "a") -> Coordinator:
    return Coordinator("127.0.0.1", 0, "job", node, connect_timeout=10.0)


def _stranger(coord: Coordinator) -> TCPStore:
    return TCPStore("127.0.0.1", coord.port, is_master=False, timeout=timedelta(seconds=10))


def test_the_hosted_store_listens_on_the_endpoint_host_only():
    """issue 20 item 3: with a 127.0.0.1 endpoint the store listened on every interface
    (``[::]``), open to the whole network."""
    coord = _coord()
    assert coord.hosting
    addrs = _listening(coord.port)
    assert addrs == ["0100007F"], f"listening on {addrs}, not only 127.0.0.1"


def test_malformed_values_are_logged_and_ignored(caplog):
    """issue 20 item 3: ``int()`` on a store value crashed the supervisor; a ``stop`` of
    ``"0 ..."`` made it exit 0 as if the job had finished."""
    coord = _coord()
    s = _stranger(coord)
    k = "unbroken/job/"
    caplog.set_level(logging.WARNING)
    assert coord.gen() == 0
    for bad in ("x", "", "1e3", "-4", "\xff"):
        s.set(k + "gen", bad)
        assert coord.gen() == 0, bad  # the last good value
    assert coord.bump(0) == 1  # and a restart still moves on
    assert coord.gen() == 1
    for bad in ("0 finished by a stranger", "0", "abc", "", "99 no such exit code", "-3 x"):
        s.set(k + "stop", bad)
        assert coord.get_stop() is None, bad
    s.set(k + "stop", "3 the same failure twice \x1b[2J")
    assert coord.get_stop() == (3, "the same failure twice \\x1b[2J")  # printable
    s.set(k + "nodes", b"a\n\xff\xfe\nb\n")  # type: ignore[arg-type]  # bytes: not UTF-8
    s.set(k + "alive/b", "not a time")
    assert coord.peers() == {}
    s.set(k + "alive/b", "nan")
    assert coord.peers() == {}
    assert "malformed" in caplog.text
