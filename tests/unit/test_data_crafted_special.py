"""A dataset file that is not a regular file (T-BOUNDED, never a hang): a FIFO where an index,
a shard, ``dataset.json``, a flat file's manifest or ``meta.pkl`` should be blocks ``open``
forever (no writer ever comes), and a symlink to ``/dev/zero`` reads without end (an index is
read whole: memory grows until the OOM killer). Each must be refused at once, naming the file.

The reads run in one child process, each under a 10 s alarm, with a 2 GiB address-space
limit, so a regression fails the test instead of hanging it or exhausting the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from datakit import build_tar_dataset, build_token_dataset
from unbroken.data.tokens.flat import index_flat

_CHILD = r"""
import json, resource, signal, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import numpy as np
from unbroken.data.stream.dataset import StreamingDataset
from unbroken.data.tokens.flat import read_vocab_size

class Hang(BaseException):  # not an OSError: no `except OSError` in the code swallows it
    pass

def _late(*_):
    raise Hang("no answer within 10 s")

signal.signal(signal.SIGALRM, _late)
out = {}
for kind, path, kw in json.loads(sys.argv[1]):
    signal.alarm(10)  # interrupts a blocked open() (PEP 475: the handler's error wins)
    try:
        if kind == "meta":
            read_vocab_size(path)
        else:
            ds = StreamingDataset(path, seed=0, **kw)
            ds.read(0, np.arange(ds.epoch_length))
        out[path] = "READ"
    except BaseException as e:
        out[path] = type(e).__name__ + " " + str(e).replace("\n", " ")
    finally:
        signal.alarm(0)
print(json.dumps(out))
"""


def _plant(path: str, what: str) -> None:
    os.unlink(path)
    if what == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every case below planted in its own copy, then read by one child process (one import
    of torch for all), each read under a 10 s alarm."""
    base = tmp_path_factory.mktemp("special")
    src = {
        "tar": build_tar_dataset(str(base / "tar"), 8, shard_size=12_000),
        "tok": build_token_dataset(str(base / "tok"), 2, 600, seq_len=8, block_tokens=256),
    }
    cases: list[tuple[str, str, dict[str, object]]] = []
    for what in ("fifo", "zero"):
        for kind, name in DATASET_FILES:
            root = shutil.copytree(src[kind], str(base / f"{kind}-{name}-{what}"))
            _plant(os.path.join(root, name), what)
            cases.append(("dataset", root, {}))
        for name in FLAT_FILES:
            d = base / f"flat-{name}-{what}"
            d.mkdir()
            np.arange(3000, dtype=np.uint16).tofile(d / "train.bin")
            index_flat(str(d / "train.bin"), vocab_size=3000, fsync=False)
            _plant(str(d / name), what)
            cases.append(("dataset", str(d / "train.bin"), {"seq_len": 16}))
        meta = base / f"meta-{what}.pkl"
        meta.write_bytes(b"")
        _plant(str(meta), what)
        cases.append(("meta", str(meta), {}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=10 * len(cases) + 60,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


DATASET_FILES = [
    ("tar", "shard-000000.tar.idx"),
    ("tar", "shard-000000.tar"),
    ("tar", "dataset.json"),
    ("tok", "tokens-000001.bin.idx"),
    ("tok", "tokens-000001.bin"),
]
FLAT_FILES = ["train.bin.dataset.json", "train.bin.idx"]


@pytest.mark.parametrize("what", ["fifo", "zero"])
@pytest.mark.parametrize("src,name", DATASET_FILES)
def test_a_special_file_in_a_dataset_is_refused_at_once(outcomes, src, name, what):
    got = next(v for k, v in outcomes.items() if k.endswith(f"{src}-{name}-{what}"))
    assert got.split()[0] in ("ShardError", "ManifestError", "FileNotFoundError"), got
    assert name in got, got


@pytest.mark.parametrize("what", ["fifo", "zero"])
@pytest.mark.parametrize("name", FLAT_FILES)
def test_a_special_file_beside_a_flat_token_file_is_refused_at_once(outcomes, name, what):
    got = next(v for k, v in outcomes.items() if f"flat-{name}-{what}" in k)
    assert got.split()[0] in ("ShardError", "ManifestError"), got
    assert name in got, got


@pytest.mark.parametrize("what", ["fifo", "zero"])
def test_a_special_meta_pkl_is_refused_at_once(outcomes, what):
    path, got = next((k, v) for k, v in outcomes.items() if k.endswith(f"meta-{what}.pkl"))
    assert got.startswith("ValueError") and path in got, got
