"""Coordination between the supervisors of one job, through the rendezvous TCP store.

The supervisor on the rendezvous host *hosts* the c10d TCPStore itself; every torchrun agent
(also the local one) joins it as a client (``--rdzv-conf is_host=false``). The store thus
outlives every agent and worker restart, instead of dying with whichever agent happened to
host it (pytorch#135712: stale or vanished store across restarts).

Keys under ``unbroken/<run_id>/``:

``gen``            the restart generation; torchrun attempts use rendezvous id
                   ``<run_id>-g<gen>``. A failing node bumps it (compare-and-set), the others
                   see the bump, stop their stale agents and join the new generation. A fresh
                   id per generation is needed anyway: torchrun closes a rendezvous for good
                   when an agent exits after a worker failure.
``nodes``          newline-separated node names (append-only)
``alive/<node>``   Unix time of that supervisor's last tick (node-loss verdicts)
``stop``           ``<exit code> <reason>``: one supervisor stopped the job; all stop
``done/<node>``    that supervisor's exit code; the hosting supervisor keeps the store up
                   until every live peer is done
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import time
from datetime import timedelta
from typing import Any

__all__ = ["Coordinator", "free_port", "is_local_host"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may take it
    before it is bound again)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


class Coordinator:
    """Hosts or joins the store at ``host:port`` (port 0: host on a free port)."""

    def __init__(self, host: str, port: int, run_id: str, node: str, *, connect_timeout: float):
        from torch.distributed import TCPStore  # lazy: keeps `unbroken --help` fast

        self.host = host
        self.node = node
        self.hosting = False
        self._prefix = f"unbroken/{run_id}/"
        store: Any = None
        if port == 0 or is_local_host(host):
            try:
                store = TCPStore(
                    host,
                    port,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=connect_timeout),
                )
                self.hosting = True
            except (RuntimeError, ValueError) as e:
                if port == 0:
                    raise RuntimeError(f"cannot host the rendezvous store on {host}: {e}") from e
                log.info("store %s:%d is hosted elsewhere (%s); joining it", host, port, e)
        if store is None:
            try:
                store = TCPStore(
                    host, port, is_master=False, timeout=timedelta(seconds=connect_timeout)
                )
            except (RuntimeError, ValueError) as e:
                raise RuntimeError(
                    f"cannot reach the rendezvous store at {host}:{port} within "
                    f"{connect_timeout:g} s: {e}; start the supervisor on that host first or "
                    "fix --rdzv-endpoint"
                ) from e
        self._store = store
        self.port = int(store.port)
        self._store.compare_set(self._k("gen"), "", "0")
        self.tick()
        self._store.append(self._k("nodes"), node + "\n")

    def _k(self, name: str) -> str:
        return self._prefix + name

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def gen(self) -> int:
        return int(self._store.get(self._k("gen")))

    def bump(self, from_gen: int) -> int:
        """Move to generation ``from_gen + 1`` unless another node already moved on."""
        got = self._store.compare_set(self._k("gen"), str(from_gen), str(from_gen + 1))
        return int(got)

    def tick(self) -> None:
        self._store.set(self._k(f"alive/{self.node}"), repr(time.time()))

    def peers(self) -> dict[str, float]:
        """Other nodes and the Unix time of their supervisors' last tick."""
        names = {n for n in self._store.get(self._k("nodes")).decode().split("\n") if n}
        names.discard(self.node)
        out: dict[str, float] = {}
        for n in sorted(names):
            with contextlib.suppress(RuntimeError, ValueError):
                out[n] = float(self._store.get(self._k(f"alive/{n}")))
        return out

    def set_done(self, code: int) -> None:
        self._store.set(self._k(f"done/{self.node}"), str(code))

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
                if now - t < silent_after and not self._store.check([self._k(f"done/{n}")])
            ]
            if not waiting or time.monotonic() > deadline:
                return waiting
            time.sleep(0.1)

    def set_stop(self, code: int, reason: str) -> None:
        self._store.set(self._k("stop"), f"{code} {reason}")

    def get_stop(self) -> tuple[int, str] | None:
        if not self._store.check([self._k("stop")]):
            return None
        code, _, reason = self._store.get(self._k("stop")).decode().partition(" ")
        return int(code), reason
