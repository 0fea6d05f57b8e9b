"""Hostile checkpoints: peak RSS of ``ckpt verify`` and of ``restore()`` on memory bombs.

A two-step root (steps 2 and 4 of a small model + AdamW + StepLR) is built once; for each
bomb a copy has step 4 replaced as the bomb says (checksums recomputed, so only the content
is hostile), then ``verify_steps`` and ``Checkpointer.restore`` each run in a fresh Python
process that reports its peak RSS beyond what it held before the call (``/proc/self/
clear_refs`` resets the peak; ``VmHWM - VmRSS``). The bound is the one unbroken states for
any root of B bytes of files: ``2 * B + 256 MiB``. Both must also pass over step 4
(damage) and restore step 2.

Bombs (issue 20 item 6; the sizes of the issue unless ``--small``):

* ``metadata-memo``: a 16-byte DCP ``.metadata`` whose LONG_BINPUT names memo slot 2^30
  (CPython's C unpickler would allocate a 16 GiB memo array);
* ``datapkl-memo``: the same inside the ``data.pkl`` of a tensor's ``torch.save`` blob;
* ``world-size``: a 7 KB manifest claiming ``world_size`` 5e7;
* ``manifest-20MB``: a manifest grown to 20 MB by a free-form field of empty lists;
* ``state-20MB``: a rank state file grown the same way;
* ``metadata-dicts``: a 5 MB ``.metadata`` of EMPTY_DICT opcodes (64 bytes each).

    PYTHONPATH=src python benchmarks/ckpt_bombs.py [--work DIR] [--small]

``--small``: the sizes of the regression tests (memo 2^25, world size 2e7), safe to run
against code without the bounds (what the "before" column was measured with).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from typing import Any

MiB = 1 << 20

_CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from unbroken.ckpt import Checkpointer, TrainState
from unbroken.ckpt.export import verify_steps

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

root, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(9)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
st = TrainState(model=m, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 3))
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
if mode == "restore":
    ck = Checkpointer(root, st, allow_fresh_start=True)
    try:
        got = ck.restore()
    finally:
        ck.close()
else:
    got = [v.step for v in verify_steps(root, progress=False) if v.ok]
print(json.dumps({"extra": status("VmHWM") - base, "result": got}))
"""


def _state() -> Any:
    import torch

    from unbroken.ckpt import TrainState

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    return TrainState(model=m, optimizer=opt, scheduler=sched), m, opt


def build(root: str) -> None:
    import torch

    from unbroken.ckpt import Checkpointer

    st, m, opt = _state()
    ck = Checkpointer(root, st, keep_last=None)
    for s in (2, 4):
        while st.step < s:
            m(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            st.components["scheduler"].step()
            st.step += 1
        ck.save()
    ck.close()


def _step4(root: str) -> str:
    return os.path.join(root, "step-00000004")


def _manifest(d: str) -> dict[str, Any]:
    with open(os.path.join(d, "manifest.json"), "rb") as f:
        return json.loads(f.read())  # type: ignore[no-any-return]


def _write_manifest(d: str, m: dict[str, Any]) -> None:
    from unbroken.ckpt.manifest import manifest_digest

    m["manifest_checksum"] = manifest_digest(m)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write(json.dumps(m))


def _replace(d: str, name: str, data: bytes) -> None:
    """Replace a file and record its size and checksum, as an attacker would."""
    from unbroken.common.fs import checksum_bytes

    with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    m = _manifest(d)
    m["files"][name] = {"size": len(data), "checksum": checksum_bytes(data)}
    _write_manifest(d, m)


def _memo(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def bombs(small: bool) -> dict[str, Callable[[str], None]]:
    memo = 1 << (25 if small else 30)
    world = 20_000_000 if small else 50_000_000

    def metadata_memo(root: str) -> None:
        _replace(_step4(root), ".metadata", b"\x80\x04}" + _memo(memo) + b".")

    def datapkl_memo(root: str) -> None:
        d = _step4(root)
        raw = io.BytesIO()
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", b"\x80\x02}" + _memo(memo) + b".")
            z.writestr("archive/byteorder", b"little")
            z.writestr("archive/data/0", bytes(32 * 16 * 4))
        blob = raw.getvalue()
        _replace(d, "__9_0.distcp", blob)
        m = _manifest(d)
        m["tensors"]["components/model/0.weight"]["chunks"][0].update(
            file="__9_0.distcp", offset=0, length=len(blob)
        )
        _write_manifest(d, m)

    def world_size(root: str) -> None:
        d = _step4(root)
        m = _manifest(d)
        m["world_size"] = world
        _write_manifest(d, m)

    def manifest_20mb(root: str) -> None:
        d = _step4(root)
        m = _manifest(d)
        m["data_state"] = [[]] * 6_500_000
        _write_manifest(d, m)

    def state_20mb(root: str) -> None:
        d = _step4(root)
        with open(os.path.join(d, "state-rank0.json"), "rb") as f:
            blob = json.loads(f.read())
        blob["state"]["components"]["scheduler"]["x"] = [[]] * 6_500_000
        _replace(d, "state-rank0.json", json.dumps(blob).encode())

    def metadata_dicts(root: str) -> None:
        _replace(_step4(root), ".metadata", b"\x80\x04(" + b"}" * 5_000_000 + b"l.")

    return {
        "metadata-memo": metadata_memo,
        "datapkl-memo": datapkl_memo,
        "world-size": world_size,
        "manifest-20MB": manifest_20mb,
        "state-20MB": state_20mb,
        "metadata-dicts": metadata_dicts,
    }


def _bytes(root: str) -> int:
    return sum(
        os.lstat(os.path.join(dp, n)).st_size for dp, _, names in os.walk(root) for n in names
    )


def measure(root: str, mode: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, root, mode], capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        return {"extra": None, "result": f"exit {proc.returncode}: {proc.stderr[-300:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/unbroken-bench-bombs")
    ap.add_argument("--small", action="store_true", help="the regression tests' sizes")
    a = ap.parse_args()
    pristine = os.path.join(a.work, "pristine")
    shutil.rmtree(a.work, ignore_errors=True)
    build(pristine)
    print(f"load average {os.getloadavg()[0]:.1f}; bound = 2 * B + 256 MiB", flush=True)
    rows = []
    for name, bomb in bombs(a.small).items():
        root = os.path.join(a.work, name)
        shutil.copytree(pristine, root)
        bomb(root)
        b = _bytes(root)
        bound = 2 * b + 256 * MiB
        got = {mode: measure(root, mode) for mode in ("verify", "restore")}
        ok = (
            got["verify"]["result"] == [2]
            and got["restore"]["result"] == 2
            and all(g["extra"] is not None and g["extra"] < bound for g in got.values())
        )
        row = {"bomb": name, "B": b, "bound": bound, **got, "ok": ok}
        print(json.dumps(row), flush=True)
        rows.append(row)
        shutil.rmtree(root)

    def mib(x: Any) -> str:
        return "-" if x is None else f"{x / MiB:.0f}"

    print(
        "\n| bomb | files B | bound 2B+256 MiB | verify peak | restore peak | verify / restore say |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        v, s = r["verify"], r["restore"]
        print(
            f"| {r['bomb']} | {r['B'] / MiB:.2f} MiB | {mib(r['bound'])} MiB | "
            f"{mib(v['extra'])} MiB | {mib(s['extra'])} MiB | intact {v['result']} / "
            f"restored {s['result']} |"
        )


if __name__ == "__main__":
    main()
