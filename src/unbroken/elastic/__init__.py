"""Lifeline 2b: keep a torchrun job alive unattended (`unbroken run`, `unbroken preflight`).

In the training loop, only three calls matter, all no-ops when not run under ``unbroken run``::

    from unbroken.elastic import beat, finishing, mark
    beat(step)                                  # every step: progress for the hang watchdog
    mark("loaded", step=s, seconds=dt)          # after a restore (Checkpointer does this)
    finishing()                                 # after the loop: the final save and exit
                                                # get --shutdown-timeout, not --hang-timeout

A SIGTERM handler of your own calls ``peer_failed()`` first: when it returns a reason, a
rank of the job died and no collective (so no save) can finish; exit at once.

Importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unbroken.common.events import mark, peer_failed
from unbroken.common.lazy import lazy_getattr
from unbroken.elastic.faults import (
    DEFAULT_RULES,
    Action,
    Classification,
    FaultClass,
    RestartPolicy,
    Rule,
    classify,
)
from unbroken.elastic.heartbeat import beat, finishing, install
from unbroken.elastic.planner import daly_interval, expected_goodput, plan, young_interval
from unbroken.elastic.preflight import CheckResult, PreflightConfig, run_preflight
from unbroken.elastic.rendezvous import RendezvousConfig

# The supervisor loads on first use: it imports the launch modules, and importing them here
# would put ``unbroken.elastic.launch.standby`` in sys.modules before ``python -m`` runs it
# (runpy's RuntimeWarning on every attempt); a training loop importing ``beat`` needs none.
_LAZY = {
    "RunConfig": "unbroken.elastic.supervisor",
    "Supervisor": "unbroken.elastic.supervisor",
    "WatchdogConfig": "unbroken.elastic.supervisor",
    "run": "unbroken.elastic.supervisor",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

if TYPE_CHECKING:  # the type checker sees what __getattr__ resolves at run time
    from unbroken.elastic.supervisor import RunConfig, Supervisor, WatchdogConfig, run

__all__ = [
    "DEFAULT_RULES",
    "Action",
    "CheckResult",
    "Classification",
    "FaultClass",
    "PreflightConfig",
    "RendezvousConfig",
    "RestartPolicy",
    "Rule",
    "RunConfig",
    "Supervisor",
    "WatchdogConfig",
    "beat",
    "classify",
    "daly_interval",
    "expected_goodput",
    "finishing",
    "install",
    "mark",
    "peer_failed",
    "plan",
    "run",
    "run_preflight",
    "young_interval",
]
