"""A node's torchrun agent under ``unbroken run``, with rank 0's ``MASTER_PORT`` held.

``unbroken run`` turns torch's agent-shared TCPStore off (``attempt_env``: it breaks late
joiners and in-agent restarts), so the agent of rank 0 picks the workers' ``MASTER_PORT``
itself, with torch's ``get_free_port()``: a port bound for an instant and closed, then
published, and bound again only when rank 0's worker hosts its ``env://`` store, seconds
later. Any process on the node could take it in between (a gloo connection, another job's
store): ``init_process_group`` then failed with EADDRINUSE (seen with three node-loss drills
on one box). :func:`hold_master_port` keeps that port bound by the agent (``SO_REUSEADDR``,
never listening) until the next round picks another: the kernel gives it to no ``bind`` to
port 0 and no ``connect``, and the worker's store (``SO_REUSEADDR`` too) binds it all the same.
A process that binds it on purpose with ``SO_REUSEADDR`` still can (as it can take the port
torch leaves free): held against accidents, not against an attacker on the node (README,
"Security model").

The standby (:mod:`.standby`) calls it before it runs torchrun in-process; without a standby
``unbroken run`` starts ``python -m unbroken.elastic.launch.agent TORCHRUN_ARGS``, which is
``python -m torch.distributed.run`` with the port held. Where torch has no
``rendezvous.api.get_free_port`` to replace (another version), torchrun runs as it is.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

from unbroken.elastic.rendezvous import held_socket

__all__ = ["hold_master_port", "main"]

_held: list[socket.socket] = []
_torchs: list[Callable[[], int]] = []  # torch's own get_free_port, where a hold fails


def _held_free_port() -> int:
    """A port no other socket of this node gets while it is held: bound here with
    ``SO_REUSEADDR`` on every IPv4 address and never listening. The previous round's port is
    let go (its workers are gone, or have bound it). Where no such socket can be bound (a
    host without IPv4), torch's own free port, as before."""
    try:
        s = held_socket("")
    except OSError:
        return _torchs[0]()
    while _held:
        _held.pop().close()
    _held.append(s)
    return int(s.getsockname()[1])


def hold_master_port() -> bool:
    """Make torchrun's rendezvous pick rank 0's ``MASTER_PORT`` with :func:`_held_free_port`
    (idempotent); False where this torch has nothing to replace."""
    from torch.distributed.elastic.rendezvous import api

    own = getattr(api, "get_free_port", None)
    if not callable(own):
        return False
    if own is not _held_free_port:
        _torchs[:] = [own]
        api.get_free_port = _held_free_port
    return True


def main() -> None:
    """``python -m torch.distributed.run`` with :func:`hold_master_port`."""
    from torch.distributed.run import main as torchrun

    hold_master_port()
    sys.argv[0] = "torchrun"
    torchrun()


if __name__ == "__main__":
    main()
