"""A resumable metric log: JSONL on disk, TensorBoard mirror when installed.

Each line is ``{"step": N, "time": unix, <name>: value, ...}``. The log's ``state_dict`` is
the last step it logged; restoring it drops every line past that step (the run is about to
log those steps again), so a plot of the log shows one curve, never a repeated segment
(E-MEASURED). TensorBoard gets the same effect through ``purge_step``.

Only rank 0 should own a ``MetricLog`` in a multi-rank job.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import IO, Any

from unbroken._fs import atomic_write_bytes

__all__ = ["MetricLog", "read_metrics"]

log = logging.getLogger(__name__)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All complete records of a metric log (a torn last line from a crash is skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    except FileNotFoundError:
        return []
    return out


class MetricLog:
    """Append-only JSONL metrics with resume semantics.

    Args:
        path: the ``.jsonl`` file (created with its directory).
        tensorboard_dir: also mirror scalars to TensorBoard here, when installed.
    """

    def __init__(self, path: str, *, tensorboard_dir: str | None = None) -> None:
        self.path = path
        self.step = -1
        self._tb_dir = tensorboard_dir
        self._tb: Any = None
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._f: IO[str] | None = None
        self._open_tb(purge_step=None)

    def _open_tb(self, purge_step: int | None) -> None:
        if self._tb_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard is not installed; metrics go to %s only", self.path)
            self._tb_dir = None
            return
        if self._tb is not None:
            self._tb.close()
        self._tb = SummaryWriter(self._tb_dir, purge_step=purge_step)

    def log(self, step: int, **values: Any) -> None:
        """Record JSON-serialisable ``values`` at ``step`` (steps must not go backwards).

        Numbers are mirrored to TensorBoard; other values (lists, strings) only go to JSONL.
        """
        if step < self.step:
            raise ValueError(
                f"metric step {step} is before the last logged step {self.step}; log steps in "
                "order (after a restore, the log resumes from the restored step)"
            )
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        rec = {"step": step, "time": round(time.time(), 3), **values}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        self.step = step
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, int | float):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    # --- Stateful ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume at ``sd["step"]``: lines logged after it (before a crash) are dropped."""
        self.close()
        step = int(sd["step"])
        records = read_metrics(self.path)
        kept = [r for r in records if r["step"] <= step]
        if len(kept) != len(records) or os.path.exists(self.path):
            body = "".join(json.dumps(r) + "\n" for r in kept)
            atomic_write_bytes(self.path, body.encode())
            if len(kept) != len(records):
                log.info(
                    "metric log %s: dropped %d entries past restored step %d",
                    self.path,
                    len(records) - len(kept),
                    step,
                )
        self.step = step
        self._open_tb(purge_step=step + 1)
