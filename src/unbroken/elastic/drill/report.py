"""The drill's report: ``drill.txt`` (a table and each fault's checks) and ``drill.json``."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from unbroken.common.jsonable import plain_json
from unbroken.common.tables import cell, render_table
from unbroken.elastic.drill.judge import FaultResult, RunComparison
from unbroken.elastic.drill.plan import FaultSpec

__all__ = ["DrillReport"]

_PHASES = ("detect", "relaunch", "load", "catch_up", "total")
_HEADER = (
    "#",
    "fault",
    "run",
    "step",
    "restored",
    "detect",
    "relaunch",
    "load",
    "catch-up",
    "total",
    "verdict",
)


@dataclass
class DrillReport:
    drill_dir: str
    command: list[str]
    seed: int
    plan: list[FaultSpec]
    faults: list[FaultResult]
    runs: list[RunComparison]
    exits: dict[str, int | None]
    wall: float = 0.0
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return (
            bool(self.faults)
            and all(f.passed for f in self.faults)
            and all(r.passed for r in self.runs)
            and all(c == 0 for c in self.exits.values() if c is not None)
        )

    def cause(self) -> str:
        """The first concrete mismatch, for the headline: the job's own failure after a
        restore when there was one (it is what made the runs part), else the first failed
        check's finding; "" when the drill passed."""
        if self.passed:
            return ""
        runs = [c for r in self.runs for c in r.checks if not c.ok]
        own = next((c.cause for c in runs if c.name == "failures" and c.cause), "")
        if own:
            return own
        for f in self.faults:
            for c in f.checks:
                if not c.ok:
                    return f"fault #{f.injection.spec.index} {f.injection.spec.kind}: " + (
                        c.cause or f"{c.name}: {c.detail}"
                    )
        bad = runs[0] if runs else None
        return (bad.cause or f"{bad.name}: {bad.detail}") if bad else self.reasons()[0]

    def reasons(self) -> list[str]:
        out = [
            f"fault #{f.injection.spec.index} {f.injection.spec.kind}: {f.why}"
            for f in self.faults
            if not f.passed
        ]
        out += [
            f"{r.run} run vs reference: {c.name}: {c.detail}"
            for r in self.runs
            for c in r.checks
            if not c.ok
        ]
        out += [
            f"supervisor {n} exited {c}" for n, c in self.exits.items() if c is not None and c != 0
        ]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "drill_dir": self.drill_dir,
            "command": self.command,
            "seed": self.seed,
            "wall_seconds": round(self.wall, 2),
            "plan": [asdict(p) for p in self.plan],
            "faults": [
                {
                    "spec": asdict(f.injection.spec),
                    "passed": f.passed,
                    "verdict": f.verdict,
                    "injection": plain_json(
                        {k: v for k, v in asdict(f.injection).items() if k != "spec"}
                    ),
                    "checks": [asdict(c) for c in f.checks],
                    "failure": f.failure,
                    "recovery": f.recovery,
                    "restored": f.restored,
                }
                for f in self.faults
            ],
            "runs": [
                {
                    "run": r.run,
                    "reference": r.reference,
                    "job": r.job,
                    "world_reference": r.world_reference,
                    "exact_until": r.exact_until,
                    "steps": r.steps,
                    "passed": r.passed,
                    "checks": [asdict(c) for c in r.checks],
                    "comparison": r.result,
                }
                for r in self.runs
            ],
            "exits": self.exits,
            "reasons": self.reasons(),
            "cause": self.cause(),
            "notes": self.notes,
            "files": self.files,
        }

    def format_table(self) -> str:
        n = len(self.faults)
        verdict = "PASS" if self.passed else f"FAIL: {self.cause()[:300]}"
        head = (
            f"unbroken drill: {n} fault{'s' if n != 1 else ''}, seed {self.seed}: "
            f"{verdict}   ({self.drill_dir})"
        )
        lines = [head, "", self._fault_table(), "", *self._check_lines(), ""]
        lines += [f"note: {x}" for x in self.notes]
        lines += self._result_lines()
        return "\n".join(lines)

    def _fault_table(self) -> str:
        rows = []
        for f in self.faults:
            inj, rec = f.injection, f.recovery or {}
            rows.append(
                (
                    inj.spec.index,
                    inj.spec.kind,
                    inj.spec.run,
                    cell(inj.step if inj.step is not None else inj.spec.step),
                    cell(f.restored),
                    *(cell(rec.get(p), ".2f") for p in _PHASES),
                    f.verdict,
                )
            )
        return render_table(rows, header=_HEADER, right={0, 3, 4, 5, 6, 7, 8, 9})

    def _check_lines(self) -> list[str]:
        lines = []
        for f in self.faults:
            inj = f.injection
            lines.append(f"#{inj.spec.index} {inj.spec.kind}: {inj.detail or inj.error}")
            lines += [f"     {c.mark} {c.name}: {c.detail}" for c in f.checks[1:]]
        for r in self.runs:
            lines += [
                "",
                f"{r.run} run vs its reference ({r.world_reference} rank"
                f"{'s' if r.world_reference > 1 else ''}, {r.reference}):",
            ]
            lines += [f"     {c.mark} {c.name}: {c.detail}" for c in r.checks]
        return lines

    def _result_lines(self) -> list[str]:
        if not self.passed:
            return ["result: FAIL", *(f"  - {x}" for x in self.reasons())]
        lines = [
            "result: PASS: every fault was recovered and the resumed runs match their references"
        ]
        for f in self.faults:
            for c in f.checks:
                if c.skipped:
                    lines.append(f"  (fault #{f.injection.spec.index} {c.name}: {c.detail})")
        return lines

    def write(self) -> None:
        """``drill.txt`` and ``drill.json`` in the drill directory."""
        from unbroken.common.fs import atomic_write_bytes

        txt = os.path.join(self.drill_dir, "drill.txt")
        js = os.path.join(self.drill_dir, "drill.json")
        self.files.update(table=txt, json=js)
        atomic_write_bytes(txt, (self.format_table() + "\n").encode())
        atomic_write_bytes(js, json.dumps(self.to_json(), indent=1, default=str).encode())
