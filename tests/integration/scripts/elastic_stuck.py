"""Test-only worker that installs its heartbeat, then never takes a step (a hang before the
first step, e.g. a stuck collective during initialisation). No torch import: starts fast."""

from __future__ import annotations

import time

from unbroken.elastic import install


def stuck_before_first_step() -> None:
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    install()
    stuck_before_first_step()
