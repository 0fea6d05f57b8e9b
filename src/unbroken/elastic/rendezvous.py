"""Coordination between the supervisors of one job, through the rendezvous TCP store.

The supervisor on the rendezvous host *hosts* the c10d TCPStore itself
(:class:`Coordinator`, configured by :class:`RendezvousConfig`); every torchrun agent (also
the local one) joins it as a client, so the store outlives every agent and worker restart
(pytorch#135712: stale or vanished store across restarts). The keys under
``unbroken/<run_id>/``: ``gen`` (the restart generation, bumped by compare-and-set),
``nodes``, ``alive/<node>``, ``stop`` and ``done/<node>``.

The store has no authentication (T-SHARED-NODE): the hosting supervisor listens on the
endpoint's host only (127.0.0.1 by default, not every interface), and every value read back
is parsed with a fallback: a malformed one is logged once and ignored, never a crash, and a
``stop`` only counts with an exit code a stop can have (never 0).

What each key holds and why a fresh rendezvous id per generation: ARCHITECTURE.md, "Design
notes" > elastic > the rendezvous store.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from unbroken.common.text import printable
from unbroken.elastic.faults import STOP_EXITS

__all__ = [
    "Coordinator",
    "RendezvousConfig",
    "free_port",
    "held_socket",
    "is_local_host",
    "reserved_port",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RendezvousConfig:
    """Where and how the nodes' supervisors meet (torchrun's c10d rendezvous)."""

    nnodes: str = "1"
    """``N`` or ``MIN:MAX`` nodes (torchrun's ``--nnodes``)."""
    endpoint: str = "127.0.0.1:0"
    """``host:port`` of the store; port 0 (single node only) hosts it on a free port."""
    run_id: str = "unbroken"
    """Job name shared by all nodes: supervisors of different jobs on one store never meet."""
    node: str = ""
    """This node's name among the supervisors (default ``<hostname>-<pid>``)."""
    last_call_timeout: float = 5.0
    """Once MIN nodes joined, wait this long for more before starting (seconds)."""
    join_timeout: float = 600.0
    """Give up a rendezvous that does not reach MIN nodes within this many seconds."""
    node_timeout: float = 5.0
    """A peer supervisor silent this long after a failure counts as a lost node."""

    def __post_init__(self) -> None:
        lo, hi = self.bounds
        if lo < 1 or hi < lo:
            raise ValueError(f"nnodes={self.nnodes!r}: need 1 <= MIN <= MAX, e.g. '1:2'")
        host, sep, port = self.endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"rdzv endpoint {self.endpoint!r} is not HOST:PORT")
        if hi > 1 and int(port) == 0:
            raise ValueError(
                f"nnodes={self.nnodes!r} spans nodes: pass --rdzv-endpoint HOST:PORT with a "
                "fixed port that every node can reach"
            )
        if min(self.last_call_timeout, self.join_timeout, self.node_timeout) <= 0:
            raise ValueError("last_call_timeout, join_timeout and node_timeout must be > 0")

    @property
    def bounds(self) -> tuple[int, int]:
        lo, _, hi = self.nnodes.partition(":")
        try:
            return int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"nnodes={self.nnodes!r} is not N or MIN:MAX") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may take it
    before it is bound again)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def held_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a port of the OS's choosing on ``host`` ("" for every IPv4
    address) with ``SO_REUSEADDR``, never listening: while it is open the kernel gives that
    port neither to a ``bind`` to port 0 nor to a ``connect``'s ephemeral port, and a server
    with ``SO_REUSEADDR`` still binds it by number (see :func:`reserved_port`)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
    except OSError:
        s.close()
        raise
    return s


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` that no other socket gets for the block, except a server that
    binds it by number with ``SO_REUSEADDR`` (the hosting supervisor's store does): it stays
    bound here, with ``SO_REUSEADDR`` and never listening, so the kernel gives it neither to
    a ``bind`` to port 0 nor to a ``connect``'s ephemeral port. Use it where a port must be
    named before its server starts (an ``--rdzv-endpoint`` several supervisors are given):
    :func:`free_port`'s number is free only at the moment it returns, and until the server
    binds it any process on the box can take it (``EADDRINUSE``)."""
    with held_socket(host) as s:
        yield int(s.getsockname()[1])


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (loopback, hostname, or one of its addresses)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(mine & theirs)


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s address (the first that binds), port ``port``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise OSError(f"{host}: cannot resolve ({e})") from None
    err: OSError = OSError(f"{host}: no address to listen on")
    for family, kind, proto, _name, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
        except OSError as e:
            sock.close()
            err = e
            continue
        return sock
    raise err


class Coordinator:
    """Hosts or joins the store at ``host:port`` (port 0: host on a free port).

    A hosted store listens on the address ``host`` resolves to, and on no other interface.
    ``multi_node``: warn when that address is a loopback one (other machines cannot reach
    it). Raises ``RuntimeError`` when the store cannot be hosted or reached; afterwards
    every method raises ``RuntimeError`` only when the store is lost or silent.

    Every store call has a deadline, ``call_timeout`` (joining a store,
    ``connect_timeout`` plus a margin): torch's client waits for an answer without bound
    once a host took the connection, so a frozen host (SIGSTOP, a stalled VM) or a program
    that took the port and says nothing held the caller forever, deaf to SIGTERM. The call
    runs on a helper thread; past its deadline it is left waiting there, and every call
    until it ends fails at once (the connection carries one request at a time). Once the
    host answers it, the store serves again.
    """

    def __init__(
        self,
        host: str,
        port: int,
        run_id: str,
        node: str,
        *,
        connect_timeout: float,
        call_timeout: float = 10.0,
        multi_node: bool = False,
    ):
        self.host = host
        self.node = node
        self.hosting = False
        self._call_timeout = call_timeout
        self._unanswered: tuple[threading.Thread, str, float] | None = None
        self._prefix = f"unbroken/{run_id}/"
        self._gen = 0
        self._warned: set[tuple[str, bytes]] = set()
        store: Any = None
        if port == 0 or is_local_host(host):
            store = self._host(host, port, connect_timeout, multi_node)
        if store is None:
            store = self._join(host, port, connect_timeout)
        self._store = store
        self.port = int(store.port)
        self._call("compare_set", self._k("gen"), "", "0")
        self.tick()
        self._call("append", self._k("nodes"), node + "\n")

    def _host(self, host: str, port: int, timeout: float, multi_node: bool) -> Any:
        """The store served from this process on ``host:port``; None when another process
        already hosts it (the caller joins)."""
        from torch.distributed import TCPStore  # lazy: keeps `unbroken --help` fast

        try:
            sock = _listen(host, port)
            address, bound = sock.getsockname()[:2]
            store = TCPStore(
                host,
                bound,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout),
                master_listen_fd=sock.detach(),  # the store owns the descriptor from here
            )
        except (OSError, RuntimeError, ValueError) as e:
            if port == 0:
                raise RuntimeError(f"cannot host the rendezvous store on {host}: {e}") from e
            log.info("store %s:%d is hosted elsewhere (%s); joining it", host, port, e)
            return None
        self.hosting = True
        if multi_node and ipaddress.ip_address(address).is_loopback:
            log.warning(
                "the rendezvous store listens on %s (what %s resolves to here): only this "
                "machine can reach it; for nodes on other machines pass this node's IP "
                "address in --rdzv-endpoint",
                address,
                host,
            )
        return store

    @staticmethod
    def _join(host: str, port: int, timeout: float) -> Any:
        from torch.distributed import TCPStore

        fix = "start the supervisor on that host first or fix --rdzv-endpoint"
        try:
            ok, got = _bounded(
                TCPStore,
                host,
                port,
                is_master=False,
                timeout=timedelta(seconds=timeout),
                deadline=timeout + _JOIN_MARGIN,
            )
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(
                f"cannot reach the rendezvous store at {host}:{port} within {timeout:g} s: "
                f"{e}; {fix}"
            ) from e
        if not ok:
            raise RuntimeError(
                f"no answer from the rendezvous store at {host}:{port} within "
                f"{timeout + _JOIN_MARGIN:g} s: something took the connection and never "
                f"answered (another program on that port, or a frozen host); {fix}"
            )
        return got

    def _call(self, method: str, *args: Any) -> Any:
        """``self._store.<method>(*args)``, bounded by the call timeout (class docstring)."""
        if self._unanswered is not None:
            thread, what, since = self._unanswered
            if thread.is_alive():
                raise RuntimeError(
                    f"the rendezvous store at {self.endpoint} still waits for an answer to "
                    f"{what}, sent {time.monotonic() - since:.0f} s ago: its host is "
                    "stopped, frozen or unreachable"
                )
            self._unanswered = None
        since = time.monotonic()
        ok, got = _bounded(getattr(self._store, method), *args, deadline=self._call_timeout)
        if not ok:
            self._unanswered = (got, method, since)
            raise RuntimeError(
                f"no answer from the rendezvous store at {self.endpoint} to {method} within "
                f"{self._call_timeout:g} s: its host is stopped, frozen or unreachable"
            )
        return got

    def _k(self, name: str) -> str:
        return self._prefix + name

    def _read(self, name: str) -> bytes | None:
        """A key's value, None when it is not there, at once: a ``get`` would wait for a
        missing key until the store's timeout (the join timeout), and anyone who reaches
        the store can delete one. One ``compare_set`` that changes nothing: a missing key
        with a non-empty expected value answers that value and stays missing; a present
        one answers its own value (set to itself when it equals the marker)."""
        raw = self._call("compare_set", self._k(name), _ABSENT, _ABSENT)
        return None if raw == _ABSENT.encode() else raw

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _malformed(self, name: str, raw: bytes, why: str) -> None:
        """Log a bad value once (per key and value): anyone who reaches the store can write."""
        if (name, raw) not in self._warned:
            self._warned.add((name, raw))
            log.warning(
                "rendezvous store %s: malformed %s%s = %s (%s); ignored",
                self.endpoint,
                self._prefix,
                printable(name),
                printable(raw[:200]),
                why,
            )

    def _gen_value(self, raw: bytes) -> int | None:
        text = raw.decode("ascii", "replace")
        if not text.isdigit() or len(text) > 9:
            self._malformed("gen", raw, "not a generation number")
            return None
        return int(text)

    def gen(self) -> int:
        """The restart generation (a malformed or decreasing value: the last good one)."""
        raw = self._read("gen")
        got = self._gen_value(b"" if raw is None else raw)
        if got is not None and got < self._gen:
            self._malformed("gen", str(got).encode(), f"went back from {self._gen}")
        elif got is not None:
            self._gen = got
        return self._gen

    def bump(self, from_gen: int) -> int:
        """Move to generation ``from_gen + 1`` unless another node already moved on."""
        want = str(from_gen + 1)
        got = self._gen_value(self._call("compare_set", self._k("gen"), str(from_gen), want))
        if got is None or got <= from_gen:
            self._call("set", self._k("gen"), want)  # overwrite what no node wrote
            got = from_gen + 1
        self._gen = max(self._gen, got)
        return got

    def tick(self) -> None:
        self._call("set", self._k(f"alive/{self.node}"), repr(time.time()))

    def peers(self) -> dict[str, float]:
        """Other nodes and the Unix time of their supervisors' last tick."""
        raw = self._read("nodes") or b""
        names = {n for n in raw.decode("utf-8", "replace").split("\n") if n}
        names.discard(self.node)
        out: dict[str, float] = {}
        for n in sorted(names)[:_MAX_PEERS]:
            t = self._read(f"alive/{n}")
            if t is None:
                continue
            try:
                out[n] = float(t)
            except ValueError:
                out[n] = math.nan
            if not math.isfinite(out[n]):
                del out[n]
                self._malformed(f"alive/{n}", t, "not a Unix time")
        return out

    def set_done(self, code: int) -> None:
        self._call("set", self._k(f"done/{self.node}"), str(code))

    def wait_peers_done(self, timeout: float, silent_after: float) -> list[str]:
        """Block (at most ``timeout`` s) while a live peer has not said it is done: the store
        lives in this process, and a peer still finishing must not lose it. Returns the peers
        given up on."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.time()
            waiting = [
                n
                for n, t in self.peers().items()
                if now - t < silent_after and self._read(f"done/{n}") is None
            ]
            if not waiting or time.monotonic() > deadline:
                return waiting
            time.sleep(0.1)

    def set_stop(self, code: int, reason: str) -> None:
        self._call("set", self._k("stop"), f"{code} {reason}")

    def get_stop(self) -> tuple[int, str] | None:
        """``(exit code, reason)`` once a supervisor stopped the job; None before, and for a
        value that is not ``<code> <reason>`` with a code a stop can carry (never 0)."""
        raw = self._read("stop")
        if raw is None:
            return None
        code, _, reason = raw.decode("utf-8", "replace").partition(" ")
        if not code.isdigit() or int(code) not in STOP_EXITS:
            self._malformed("stop", raw, f"not '<exit code {sorted(STOP_EXITS)}> <reason>'")
            return None
        return int(code), printable(reason[:2000])


def _bounded(fn: Any, *args: Any, deadline: float, **kwargs: Any) -> tuple[bool, Any]:
    """``(True, fn(*args, **kwargs))``, or ``(False, the thread still running it)`` after
    ``deadline`` seconds; its exception is raised here. A daemon thread of its own, not a
    pool: a pool's exit handler would join a thread that never ends."""
    done: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            done.append((True, fn(*args, **kwargs)))
        except Exception as e:  # noqa: BLE001 (raised in the caller)
            done.append((False, e))

    thread = threading.Thread(target=run, name="unbroken-rdzv-call", daemon=True)
    thread.start()
    thread.join(deadline)
    if not done:
        return False, thread
    ok, got = done[0]
    if not ok:
        raise got
    return True, got


_JOIN_MARGIN = 5.0
"""Seconds past the connect timeout that joining a store may take before it counts as silent."""
_ABSENT = "\0unbroken: no such key"
"""The expected value :meth:`Coordinator._read` compares with: no value unbroken writes."""
_MAX_PEERS = 4096
"""Node names read from ``nodes`` (a store anyone can append to) at the most."""
