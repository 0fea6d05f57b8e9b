"""Rendezvous for the tests' own ranks and servers with no window in which another process
can take their port. A plain module, not a conftest (see datakit.py).

A port picked with ``free_port()`` (bind port 0, read the number, close) is free only at
that moment: until the server binds it again, any process on the box can take it (an
ephemeral port of another test's gloo connection), and the bind fails with ``EADDRINUSE``
(``test_memtier_ranks.py`` under 3 xdist workers: "The server socket has failed to listen on
any local network address ... EADDRINUSE"). So:

* ranks meet through a ``file://`` store on a fresh file (:func:`group_file`,
  :func:`join_group`): no port at all; gloo's own connections listen on ports the kernel
  picks when it binds them;
* a server that can take port 0 does (moto: ``storekit.moto_endpoint``);
* where a port must be named before its server starts (the ``--rdzv-endpoint`` several
  supervisors are given), :func:`reserved_port` keeps it bound in the test process, with
  ``SO_REUSEADDR`` and not listening: the kernel then gives it to no other socket (neither
  a ``bind`` to port 0 nor a ``connect``'s ephemeral port), while a server that binds it
  with ``SO_REUSEADDR`` (the supervisor's store, a c10d TCPStore) still can.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator

__all__ = ["group_file", "join_group", "reserved_port"]


def group_file(directory: str) -> str:
    """The rendezvous file of one process group: a path in a new private directory under
    ``directory`` (a test's tmp dir). Fresh for every group: a FileStore keeps its keys in
    the file, and one left by earlier ranks (which exit without ``destroy_process_group``)
    would be read as the new group's."""
    return os.path.join(tempfile.mkdtemp(prefix="rdzv-", dir=directory), "store")


def join_group(rank: int, world: int, rdzv: str, backend: str = "gloo") -> None:
    """``init_process_group`` for ``rank`` of ``world`` through the file ``rdzv``
    (:func:`group_file`, the same for every rank of the group)."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{rdzv}", rank=rank, world_size=world)


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` that no other socket gets for the block, except one that binds it
    by number with ``SO_REUSEADDR`` (what a server does): see the module docstring."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        yield int(s.getsockname()[1])
