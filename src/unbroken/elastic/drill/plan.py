"""The drill's plan: which faults, where, all derived from the seed (``plan_faults``), and
the record of each injection (``Injection``, filled in by :mod:`.inject`)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ALL_KINDS",
    "ELASTIC_KINDS",
    "FAULT_KINDS",
    "MEMORY_KINDS",
    "NODES_KINDS",
    "SINGLE_KINDS",
    "FaultSpec",
    "Injection",
    "plan_faults",
]

SINGLE_KINDS = ("kill", "kill-in-save", "hang", "corrupt", "storage")
ELASTIC_KINDS = ("agent-loss", "world-size")
FAULT_KINDS = SINGLE_KINDS + ELASTIC_KINDS
NODES_KINDS = ("node-loss",)
"""Faults of the ``nodes`` run: two nodes of one rank each at a fixed world size of 2
(``--nnodes 2``): a lost node is replaced by a new one, the world never shrinks."""
MEMORY_KINDS = ("kill-memory", "memory-damage", *NODES_KINDS)
"""Faults of the memory tier (issue 25): asked for by name, for a script whose Checkpointer
publishes to it (``memory_every_steps``; the demo: ``--memory-every 1``); ``node-loss``
also needs a script that trains on 2 ranks (``--multi-rank``)."""
ALL_KINDS = FAULT_KINDS + MEMORY_KINDS


@dataclass(frozen=True)
class FaultSpec:
    """One planned fault (all fields derive from the drill's seed)."""

    index: int
    kind: str
    run: str
    """``single`` (one node, one rank), ``elastic`` (two nodes of one rank each, ``--nnodes
    1:2``) or ``nodes`` (two nodes of one rank each, ``--nnodes 2``: a lost node is replaced)."""
    step: int
    """Inject once the workers reached this step (after the previous fault's recovery)."""
    victim: int = 0
    """Which rank (or node, for agent-loss) is hit, modulo the live ones."""
    mode: str = ""
    """corrupt: ``bitflip`` or ``truncate``."""
    salt: int = 0
    """Seeded bits for the choices made at injection time (file, byte, bit)."""


@dataclass
class Injection:
    spec: FaultSpec
    t: float | None = None
    """Unix time of the injection; None when it never happened."""
    step: int | None = None
    node: str = ""
    rank: int | None = None
    pid: int | None = None
    detail: str = ""
    expected_restore: int | None = None
    """The step the recovery must restore (known when the job was frozen or dead)."""
    min_restore: int | None = None
    """A lower bound instead, when workers may still have saved after the injection."""
    facts: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def record(self, node: str, beat: Any, detail: str) -> None:
        self.t, self.step, self.node = time.time(), int(beat.step), node
        self.rank, self.pid, self.detail = int(beat.rank), int(beat.pid), detail

    @property
    def report_node(self) -> str:
        return str(self.facts.get("report_node", self.node))


def plan_faults(kinds: tuple[str, ...], steps: int, ckpt_every: int, seed: int) -> list[FaultSpec]:
    """The seeded schedule. One-node kinds in a seeded order, then the two-node kinds
    (agent-loss before world-size: after a lost node there is no second agent), then the
    fixed-world kinds (node-loss). Each fault
    falls in the first half of its own segment of steps ``2E+1 .. N-E-1``: two checkpoints
    exist before it (corrupt needs a fall-back) and a save still follows it."""
    rng = random.Random(seed)
    single = [k for k in SINGLE_KINDS + MEMORY_KINDS if k in kinds and k not in NODES_KINDS]
    rng.shuffle(single)
    groups = (
        ("single", single),
        ("elastic", [k for k in ELASTIC_KINDS if k in kinds]),
        ("nodes", [k for k in NODES_KINDS if k in kinds]),
    )
    out: list[FaultSpec] = []
    for run, group in groups:
        if not group:
            continue
        lo, hi = 2 * ckpt_every + 1, steps - ckpt_every - 1
        seg = (hi - lo + 1) // len(group)
        if seg < 2:
            need = 3 * ckpt_every + 1 + 2 * len(group)
            raise ValueError(
                f"{steps} steps with a checkpoint every {ckpt_every} are too few for "
                f"{len(group)} fault(s) in the {run} run; the script needs at least {need} steps"
            )
        for i, kind in enumerate(group):
            step = lo + i * seg + rng.randrange(max(1, seg // 2))
            mode = rng.choice(("bitflip", "truncate")) if kind == "corrupt" else ""
            out.append(
                FaultSpec(
                    len(out) + 1, kind, run, step, rng.randrange(1 << 16), mode, rng.getrandbits(32)
                )
            )
    return out
