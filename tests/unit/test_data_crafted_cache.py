"""The node cache's own files as damaged input: a name in ``<cache_dir>/.stats`` that no
process id can be (a stray or damaged entry) must not stop every later opening of the cache
with an OverflowError from ``os.kill``; it is swept like a dead reader's."""

from __future__ import annotations

import os
import subprocess
import sys

from unbroken.data.stream.remote.probe import sweep_stats


def test_stats_names_no_pid_can_be_are_swept_and_live_ones_kept(tmp_path):
    stats = tmp_path / ".stats"
    stats.mkdir(mode=0o700)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    names = {
        "99999999999999999999": False,  # > any pid: os.kill raised OverflowError
        str(2**64): False,
        "0": False,  # os.kill(0, 0) is this process group: no reader's file
        "\u0661\u0662\u0663": True,  # Arabic-Indic digits: isdigit(), but no pid name: left alone
        "abc": True,  # not ours: left alone
        dead: False,
        str(os.getpid()): True,
    }
    for n in names:
        (stats / n).write_bytes(b"\0" * 16)
    sweep_stats(str(tmp_path))
    left = set(os.listdir(stats))
    assert left == {n for n, keep in names.items() if keep}, left
