"""Pre-flight checks run before the first start and before every restart.

Each storage probe runs in its own short-lived interpreter with a timeout, because a hung
mount (NFS, Lustre, FUSE) blocks the calling thread in uninterruptible I/O; the supervisor
must survive that and report "probe timed out" instead of hanging with it. A probe that does
not finish in time is killed and left to be reaped in the background (a process stuck in
``D`` state cannot be killed by anyone; we must not wait on it).

Checks (each -> :class:`CheckResult`):

- ``ckpt_dir``: create the directory (unless the run has saved in it: then a missing
  directory fails the check), list it, write + fsync + read back + delete a probe
  file ``.unbroken-probe-<node>``; free space >= max(``min_free_bytes``, 1.2 x the newest
  ``step-*`` checkpoint).
- ``data``: the dataset path exists; if it holds ``dataset.json``, the manifest parses and
  every listed shard (and its offset index) exists with its recorded size. Checksums are
  not re-read here: that costs a full pass over the data on every restart. A URL
  (``s3://bucket/ds``) is checked the same way through the object-store layer (its manifest
  parsed, one listing of the sizes, or a HEAD per file over plain HTTP), credentials and
  endpoint from the environment.
- ``gpus``: when ``nvidia-smi`` is present: enough GPUs visible and each one's memory
  nearly free (memory held by a leftover process of the previous attempt is the usual
  reason a restart dies at once with OOM).
- ``rendezvous``: the rendezvous endpoint accepts TCP connections.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.common.fs import is_remote
from unbroken.common.tables import render_table

__all__ = [
    "CheckResult",
    "PreflightConfig",
    "format_results",
    "run_preflight",
    "wait_until_healthy",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreflightConfig:
    """What pre-flight checks (``unbroken preflight``, and ``unbroken run`` before every start);
    the single source of its defaults."""

    ckpt_dir: str | None = None
    """Checkpoint root to probe (local or mounted path); None skips the storage check."""
    data: str | None = None
    """Dataset directory, manifest or URL (``s3://bucket/ds``: credentials and endpoint from
    the environment) to validate; None skips the check."""
    min_free_bytes: int = 256 << 20
    """Free space required even before the first checkpoint exists (default 256 MiB)."""
    rdzv_endpoint: str | None = None
    """``host:port`` that must accept TCP connections; None skips the check."""
    gpus: int | None = None
    """GPUs this node needs (``--nproc-per-node``) when CUDA is present; None: any number."""
    gpu_min_free_fraction: float = 0.9
    """Each visible GPU must have at least this fraction of its memory free."""
    timeout: float = 30.0
    """Seconds each probe may take before it counts as hung."""
    node: str = ""
    """Names this node's probe file, so nodes sharing a file system never collide."""
    saved: bool = False
    """The run has saved checkpoints in ``ckpt_dir``: a missing directory is then an outage
    (fails the check), never made afresh (the job would silently start again from step 0)."""

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"preflight timeout={self.timeout} must be > 0 seconds")
        if not 0.0 <= self.gpu_min_free_fraction <= 1.0:
            raise ValueError(
                f"gpu_min_free_fraction={self.gpu_min_free_fraction} must lie in [0, 1]"
            )
        if self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes={self.min_free_bytes} must be >= 0")


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    seconds: float
    skipped: bool = False


# Probes import only the standard library and run with -I -S: ~20 ms to start, and they do
# not depend on the (possibly slow-to-import) package or on the hung storage themselves.
_STORAGE_PROBE = r"""
import errno, json, os, stat, sys
d, need, node, saved = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
def out(ok, detail):
    print(json.dumps({"ok": ok, "detail": detail})); sys.exit(0)
if saved and not os.path.lexists(d):
    out(False, f"{d} is missing, but this run saved checkpoints in it: not re-created (the "
        "job would start again from step 0); mount or restore it, the job waits for it")
def open_probe(path):
    # Never through a symlink, never truncating what is not our own single-link file: a
    # name planted in the directory (symlink, hard link) is unlinked and made afresh. Like
    # any storage call this open may block (a hung mount): the caller's timeout cuts it off.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    else:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
            os.ftruncate(fd, 0)
            return fd
        os.close(fd)
    os.unlink(path)
    return os.open(path, flags | os.O_EXCL, 0o600)
try:
    os.makedirs(d, mode=0o700, exist_ok=True)
    names = os.listdir(d)
    probe = os.path.join(d, ".unbroken-probe-" + node)
    data = os.urandom(4096)
    fd = open_probe(probe)
    try:
        os.write(fd, data); os.fsync(fd)
    finally:
        os.close(fd)
    with open(os.open(probe, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        back = f.read()
    os.unlink(probe)
    if back != data:
        out(False, "probe file read back differs from what was written")
    # the names the Checkpointer writes, step-%08d (unbroken.ckpt.store.step_of) only
    steps = [n for n in names if n[:5] == "step-" and n[5:].isascii() and n[5:].isdigit()
             and n == "step-%08d" % int(n[5:])]
    newest = 0
    if steps:
        top = os.path.join(d, max(steps, key=lambda n: int(n[5:])))
        for root, _, files in os.walk(top):
            for fn in files:
                newest += os.lstat(os.path.join(root, fn)).st_size
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    want = max(need, int(newest * 1.2))
    if free < want:
        out(False, "%d MiB free < %d MiB needed for one more checkpoint (newest %d MiB)"
            % (free >> 20, want >> 20, newest >> 20))
    out(True, "writable, %.1f GiB free" % (free / 2**30))
except OSError as e:
    out(False, "%s: %s" % (type(e).__name__, e))
"""

_DATA_PROBE = r"""
import json, os, sys
p = sys.argv[1]
def out(ok, detail):
    print(json.dumps({"ok": ok, "detail": detail})); sys.exit(0)
try:
    if not os.path.exists(p):
        out(False, "not found")
    base, manifest = p, None
    if os.path.isdir(p):
        if os.path.exists(os.path.join(p, "dataset.json")):
            manifest = os.path.join(p, "dataset.json")
    elif p.endswith(".json"):
        base, manifest = os.path.dirname(p), p
    if manifest is None:
        n = len(os.listdir(p)) if os.path.isdir(p) else 1
        out(n > 0, "%d entries (no dataset.json to validate)" % n if n else "empty directory")
    with open(manifest, encoding="utf-8") as f:
        m = json.load(f)
    shards = m.get("shards", []) if isinstance(m, dict) else []
    bad = []
    for s in shards:
        if isinstance(s, str):
            s = {"path": s}
        files = [(s.get("path") or s.get("name") or s.get("file"), s.get("bytes", s.get("size"))),
                 (s.get("index"), s.get("index_bytes"))]
        for name, size in files:
            if not name:
                continue
            try:
                real = os.stat(os.path.join(base, name)).st_size
            except OSError as e:
                bad.append("%s: %s" % (name, e.strerror)); continue
            if isinstance(size, int) and real != size:
                bad.append("%s: %d bytes, manifest says %d" % (name, real, size))
    if bad:
        out(False, "%d of %d shards bad: %s" % (len(bad), len(shards), "; ".join(bad[:3])))
    out(True, "%d shards present with the recorded sizes" % len(shards))
except (OSError, ValueError) as e:
    out(False, "%s: %s" % (type(e).__name__, e))
"""


# A remote dataset (``s3://``, ``gs://``, ``az://``, ``http(s)://``, any fsspec URL): its
# manifest read and parsed, and every listed file's size compared with one listing, through
# the object-store layer the loader uses (one HEAD per file where the store cannot list:
# plain HTTP), credentials and endpoint from the environment as the job itself gets them. Not isolated (-I): it imports unbroken wherever the job does.
_REMOTE_DATA_PROBE = r"""
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # nothing in the cwd shadows
import json
url = sys.argv[1]
def out(ok, detail):
    print(json.dumps({"ok": ok, "detail": detail})); sys.exit(0)
try:
    from unbroken.common.objstore import open_store
    from unbroken.data.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, DatasetManifest
    root, name = url.rsplit("/", 1) if url.endswith(".json") else (url.rstrip("/"), MANIFEST_NAME)
    store = open_store(root)
    bad = []
    try:
        raw = store.get_bytes(name, max_bytes=MAX_MANIFEST_BYTES)
        m = DatasetManifest.parse(raw, source=root + "/" + name)
        if root.startswith(("http://", "https://")):  # no listing there: a HEAD per file
            size_of = store.head
        else:
            size_of = store.list_objects().get
        for s in m.shards:
            for name, size in ((s.name, s.bytes), (s.index, s.index_bytes)):
                got = size_of(name) if name else size
                if got != size:
                    bad.append("%s: %s" % (name, "no such object" if got is None
                                           else "%d bytes, manifest says %d" % (got, size)))
    finally:
        store.close()
    if bad:
        out(False, "%d of %d shards bad: %s" % (len(bad), len(m.shards), "; ".join(bad[:3])))
    out(True, "%d shards present with the recorded sizes" % len(m.shards))
except Exception as e:
    out(False, "%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0]))
"""


def _reap(p: subprocess.Popen[bytes]) -> None:
    try:
        p.communicate()
    except (OSError, ValueError):
        pass


def _run_probe(argv: list[str], timeout: float) -> tuple[bool, str]:
    """Run a probe process; (ok, detail). Never blocks longer than ``timeout``."""
    try:
        p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as e:
        return False, f"cannot start probe: {e}"
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        # A process in uninterruptible I/O outlives SIGKILL: reap it in the background.
        threading.Thread(target=_reap, args=(p,), daemon=True, name="probe-reaper").start()
        return False, f"probe timed out after {timeout:g} s (hung mount or device?)"
    if p.returncode != 0 and not out:
        msg = err.decode("utf-8", "replace").strip().splitlines()
        return False, f"probe exited {p.returncode}: {msg[-1] if msg else ''}"
    return True, out.decode("utf-8", "replace")


def _json_probe(
    code: str, args: list[str], timeout: float, isolated: bool = True
) -> tuple[bool, str]:
    flags = ["-I", "-S"] if isolated else []
    ran, out = _run_probe([sys.executable, *flags, "-c", code, *args], timeout)
    if not ran:
        return False, out
    try:
        res = json.loads(out.strip().splitlines()[-1])
        return bool(res["ok"]), str(res["detail"])
    except (ValueError, KeyError, IndexError):
        return False, f"probe printed no verdict: {out[-200:]!r}"


def _timed(name: str, fn: Callable[[], tuple[bool, str] | None]) -> CheckResult:
    t0 = time.monotonic()
    res = fn()
    dt = time.monotonic() - t0
    if res is None:
        return CheckResult(name, True, "skipped", dt, skipped=True)
    return CheckResult(name, res[0], res[1], dt)


def _check_gpus(cfg: PreflightConfig) -> tuple[bool, str] | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return (
            None
            if not os.path.exists("/dev/nvidia0")
            else (False, "/dev/nvidia0 exists but nvidia-smi is not on PATH; cannot check GPUs")
        )
    ran, out = _run_probe(
        [smi, "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
        cfg.timeout,
    )
    if not ran:
        return False, f"nvidia-smi: {out}"
    rows = []
    for line in out.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and all(x.replace(".", "").isdigit() for x in parts):
            rows.append((int(parts[0]), float(parts[1]), float(parts[2])))
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None and all(v.strip().isdigit() for v in vis.split(",") if v.strip()):
        keep = {int(v) for v in vis.split(",") if v.strip()}
        rows = [r for r in rows if r[0] in keep]
    if cfg.gpus is not None and len(rows) < cfg.gpus:
        return False, f"{len(rows)} GPUs visible, {cfg.gpus} needed (--nproc-per-node)"
    busy = [
        f"GPU {i}: {used:.0f} of {total:.0f} MiB in use"
        for i, used, total in rows
        if total > 0 and (total - used) / total < cfg.gpu_min_free_fraction
    ]
    if busy:
        return False, "; ".join(busy) + " (a leftover process of a previous attempt?)"
    return True, f"{len(rows)} GPUs visible, memory free"


def _check_rdzv(cfg: PreflightConfig) -> tuple[bool, str] | None:
    if not cfg.rdzv_endpoint:
        return None
    host, _, port = cfg.rdzv_endpoint.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=cfg.timeout):
            return True, f"{cfg.rdzv_endpoint} accepts connections"
    except (OSError, ValueError) as e:
        return False, f"{cfg.rdzv_endpoint}: {e}"


def _check_data(cfg: PreflightConfig) -> tuple[bool, str] | None:
    if cfg.data is None:
        return None
    if is_remote(cfg.data):
        return _json_probe(_REMOTE_DATA_PROBE, [cfg.data], cfg.timeout, isolated=False)
    return _json_probe(_DATA_PROBE, [cfg.data], cfg.timeout)


def run_preflight(cfg: PreflightConfig) -> list[CheckResult]:
    """Run every configured check once (storage probes in subprocesses with timeouts)."""
    node = cfg.node or socket.gethostname()
    results = [
        _timed(
            "ckpt_dir",
            lambda: (
                None
                if cfg.ckpt_dir is None
                else _json_probe(
                    _STORAGE_PROBE,
                    [cfg.ckpt_dir, str(cfg.min_free_bytes), node, "1" if cfg.saved else "0"],
                    cfg.timeout,
                )
            ),
        ),
        _timed("data", lambda: _check_data(cfg)),
        _timed("gpus", lambda: _check_gpus(cfg)),
        _timed("rendezvous", lambda: _check_rdzv(cfg)),
    ]
    return results


def format_results(results: list[CheckResult]) -> str:
    rows = [
        (
            "skip" if r.skipped else ("ok" if r.ok else "FAIL"),
            r.name,
            f"{r.seconds:.2f} s",
            r.detail,
        )
        for r in results
    ]
    # the status column is as wide as "FAIL" even when every check passed: scripts grep it
    return render_table(rows, right={2}, min_widths=(4,))


def wait_until_healthy(
    cfg: PreflightConfig,
    *,
    max_wait: float,
    initial_delay: float = 1.0,
    max_delay: float = 30.0,
    on_result: Callable[[list[CheckResult], float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[bool, list[CheckResult]]:
    """Repeat :func:`run_preflight` with exponential backoff until all pass or ``max_wait``
    seconds passed (or ``should_stop()`` says so). Logs why each round failed."""
    t0 = time.monotonic()
    delay = initial_delay
    while True:
        res = run_preflight(cfg)
        waited = time.monotonic() - t0
        if on_result is not None:
            on_result(res, waited)
        if all(r.ok for r in res):
            return True, res
        why = "; ".join(f"{r.name}: {r.detail}" for r in res if not r.ok)
        if waited + delay > max_wait or (should_stop is not None and should_stop()):
            log.error("pre-flight still failing after %.1f s, giving up: %s", waited, why)
            return False, res
        log.warning("pre-flight failed (waited %.1f s): %s; retrying in %.1f s", waited, why, delay)
        end = time.monotonic() + delay
        while time.monotonic() < end:
            if should_stop is not None and should_stop():
                return False, res
            time.sleep(min(0.1, delay))
        delay = min(max_delay, delay * 2)
