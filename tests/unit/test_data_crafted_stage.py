"""``unbroken data stage`` into a directory where a FIFO sits at a file's name: a file
recorded with 0 bytes (a token shard without tokens) matched the FIFO's size, and the
"already valid?" check hashed it - an ``open`` that blocks until a writer comes, forever.
Run in a child process with a deadline, so a regression fails instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys

from unbroken.data.manifest import DatasetManifest
from unbroken.data.tokens.shard import TokenShardWriter


def test_a_fifo_in_the_stage_directory_is_replaced_not_read(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    infos = []
    for i, docs in enumerate([[[1, 2, 3]] * 4, []]):  # the second shard holds no token
        w = TokenShardWriter(str(src / f"tokens-{i:06d}.bin"), "uint16", 0, fsync=False)
        for d in docs:
            w.add(d)
        infos.append(w.commit_info(2))
    DatasetManifest.create("tokens", infos, dtype="uint16", eos_id=0, seq_len=2).save(str(src))
    assert os.path.getsize(src / "tokens-000001.bin") == 0
    os.mkfifo(dst / "tokens-000001.bin")
    code = (
        "import sys; from unbroken.data.prepare.stage import stage; "
        "print(stage(sys.argv[1], sys.argv[2], progress=False))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(src), str(dst)],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("stage hung on the FIFO (no answer within 30 s)") from None
    assert out.returncode == 0, out.stderr[-2000:]
    p = dst / "tokens-000001.bin"
    assert p.is_file() and not p.is_symlink() and p.stat().st_size == 0
    assert DatasetManifest.load(str(dst)) == DatasetManifest.load(str(src))
