"""One moto S3 server in its own process on 127.0.0.1 for the object-store benchmarks: started
through a benchmark script's ``--serve PORT_FILE`` (which writes its port there), waited for,
and stopped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["moto_process"]


@contextlib.contextmanager
def moto_process(
    script: str, port_file: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``(server process, endpoint URL)`` of ``python script --serve port_file``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(port_file)
    server = subprocess.Popen([sys.executable, script, "--serve", port_file], env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the moto server did not start")
            time.sleep(0.05)
        with open(port_file) as f:
            yield server, f"http://127.0.0.1:{f.read().strip()}"
    finally:
        server.terminate()
        server.wait(timeout=30)
