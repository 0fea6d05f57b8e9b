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

:func:`guard_rendezvous_state`: torchrun's dynamic rendezvous keeps its state in the store
as a pickle and reads it back with ``pickle.loads`` at every sync (join, keep-alive, each
membership poll); the store has no authentication and listens on 127.0.0.1 by default, so
any user of the node could run code as the job's user in its agent. The agents ``unbroken
run`` starts load it with an unpickler that resolves only the state's own classes and
check its shape: a planted state is refused (torchrun's ``RendezvousStateError``: the
attempt fails, the next generation uses a fresh key), never run.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import pickle
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from unbroken.common.text import printable
from unbroken.elastic.rendezvous import held_socket

__all__ = [
    "guard_rendezvous_state",
    "guard_torchrun",
    "hold_master_port",
    "main",
    "shutdown_uninterrupted",
]

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


_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_STATE_GLOBALS = frozenset(
    {(_RDZV, "_RendezvousState"), (_RDZV, "_NodeDesc")}
    | {("datetime", n) for n in ("datetime", "timezone", "timedelta")}
)
"""Every global a pickled rendezvous state names (its times are UTC-aware datetimes)."""


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _STATE_GLOBALS:
            raise pickle.UnpicklingError(f"it names the global {module}.{name}")
        return super().find_class(module, name)


def _check_state(state: Any) -> None:
    """Raise ``TypeError`` unless ``state`` has the shape torchrun writes."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    node_fields = {f.name for f in dataclasses.fields(dr._NodeDesc)}

    def node(n: Any) -> bool:
        return (
            type(n) is dr._NodeDesc
            and set(vars(n)) == node_fields
            and type(n.addr) is str
            and all(type(v) is int for v in (n.pid, n.local_id))
        )

    def when(t: Any) -> bool:
        return type(t) is datetime.datetime

    if type(state) is not dr._RendezvousState:
        raise TypeError(f"a {type(state).__name__}, not a rendezvous state")
    s = vars(state)
    ok = (
        set(s) == set(vars(dr._RendezvousState()))  # the fields this torch writes, no more
        and type(s["round"]) is int
        and all(type(s[k]) is bool for k in ("complete", "closed"))
        and (s["deadline"] is None or when(s["deadline"]))
        and type(s["participants"]) is dict
        and all(node(n) and type(r) is int for n, r in s["participants"].items())
        and all(
            type(s[k]) is set and all(map(node, s[k])) for k in ("wait_list", "redundancy_list")
        )
        and type(s["last_heartbeats"]) is dict
        and all(node(n) and when(t) for n, t in s["last_heartbeats"].items())
    )
    if not ok:
        raise TypeError("its fields are not those torchrun writes")


def _load_state(data: bytes) -> Any:
    """``pickle.loads`` for torchrun's rendezvous state: only its own classes, checked."""
    try:
        state = _StateUnpickler(io.BytesIO(data)).load()
        _check_state(state)
    except Exception as e:  # noqa: BLE001 - whatever the bytes hold is a refusal
        raise pickle.UnpicklingError(
            f"the rendezvous state read from the store is refused ({printable(e)[:300]}): anyone "
            "who reaches the store can write it; keep --rdzv-endpoint on a trusted network"
        ) from None
    return state


class _StatePickle:
    """``pickle`` as torchrun's dynamic rendezvous sees it: ``loads`` is :func:`_load_state`."""

    PickleError = pickle.PickleError
    dumps = staticmethod(pickle.dumps)
    loads = staticmethod(_load_state)


def guard_rendezvous_state() -> bool:
    """Make torchrun's dynamic rendezvous load its state with :func:`_load_state`
    (idempotent); False where this torch reads it some other way (nothing replaced)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    if getattr(dr, "pickle", None) is pickle:
        dr.pickle = _StatePickle  # type: ignore[assignment]
    return getattr(dr, "pickle", None) is _StatePickle


_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's


def shutdown_uninterrupted() -> bool:
    """Make torchrun's agent finish stopping its workers whatever signal comes meanwhile
    (idempotent). ``LocalElasticAgent._shutdown`` runs ``PContext.close``: signal the
    workers, wait, then stop the threads that copy their logs. A stop signal arriving in
    between raises torchrun's ``SignalException`` out of the middle of it: the log threads
    are never stopped, and the agent hangs at exit joining them, for good (seen: a
    supervisor killed outright; its agent, shutting down after losing the rendezvous store,
    got the SIGTERM of ``PR_SET_PDEATHSIG``). The shutdown runs with torchrun's stop
    signals ignored - it is what they ask for - and their handlers back after it. False
    where this torch has no such method to wrap."""
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    cls = getattr(lea, "LocalElasticAgent", None)
    own = getattr(cls, "_shutdown", None)
    if cls is None or not callable(own):
        return False
    if getattr(own, "_uninterrupted", False):
        return True

    def _shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return own(self, *args, **kwargs)  # signal handlers belong to the main thread
        old = {s: signal.signal(s, signal.SIG_IGN) for s in _STOPS}
        try:
            return own(self, *args, **kwargs)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    _shutdown._uninterrupted = True  # type: ignore[attr-defined]
    cls._shutdown = _shutdown
    return True


def guard_torchrun() -> None:
    """Everything an agent of ``unbroken run`` changes in torchrun, before it runs: rank 0's
    ``MASTER_PORT`` held until its worker hosts the store, a rendezvous state planted in the
    store refused (never unpickled), and a shutdown no stop signal cuts short."""
    hold_master_port()
    guard_rendezvous_state()
    shutdown_uninterrupted()


def main() -> None:
    """``python -m torch.distributed.run`` with :func:`guard_torchrun`."""
    from torch.distributed.run import main as torchrun

    from unbroken.elastic.launch.forkserver import die_with_supervisor

    # were the supervisor killed outright, stop the workers as torchrun does on SIGTERM
    die_with_supervisor(signal.SIGTERM)
    guard_torchrun()
    sys.argv[0] = "torchrun"
    torchrun()


if __name__ == "__main__":
    main()
