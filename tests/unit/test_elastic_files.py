"""The supervisor's files on a shared node (issue 20 item 4): the run directory must be
private, fixed names are never followed through a symlink, files are 0600, and a pid read
from a file is signalled only when it is provably one of the attempt's processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from unbroken.common import events
from unbroken.common.procs import is_alive
from unbroken.elastic import heartbeat, preflight

pytestmark = pytest.mark.timeout(60)


def _unbroken_run(run_dir: str, tmp_path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text("print('never started')\n")
    return subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", run_dir, "--", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("how", ["group-writable", "another-owner", "symlink"])
def test_a_run_directory_others_control_is_refused(tmp_path, how):
    """issue 20 item 4: an existing run directory of any owner and mode was used as is."""
    d = tmp_path / "run"
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir()
        d.symlink_to(tmp_path / "elsewhere")
    else:
        d.mkdir()
        os.chmod(d, 0o777 if how == "group-writable" else 0o700)
        if how == "another-owner":
            os.chown(d, 65534, 65534)
    r = _unbroken_run(str(d), tmp_path)
    assert r.returncode != 0
    assert str(d) in r.stderr and "run directory" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "elsewhere" / "events.jsonl")
    assert not (d.is_dir() and not d.is_symlink() and os.listdir(d)), "it wrote there anyway"


def test_a_new_run_directory_and_the_event_log_are_private(tmp_path):
    """issue 20 item 4: the run directory and events.jsonl were 0755/0644 and record argv."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    events.append_event(run_dir, {"t": 0.0, "event": "start"})
    assert stat.S_IMODE(os.stat(os.path.join(run_dir, "events.jsonl")).st_mode) == 0o600
    sub = events.private_subdir(run_dir, "attempts", "0")
    for p in (os.path.join(run_dir, "attempts"), sub):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p


def test_the_event_log_and_peer_failed_are_never_followed(tmp_path):
    """issue 20 item 4: a symlink planted at a fixed name redirected the appends (and
    reads) anywhere this user can write (or read)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    target = tmp_path / "precious"
    target.write_text('{"t": 1, "event": "secret"}\n')
    (run_dir / "events.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        events.append_event(str(run_dir), {"t": 0.0, "event": "start"})
    assert target.read_text() == '{"t": 1, "event": "secret"}\n'
    with pytest.raises(OSError):
        events.load_events(str(run_dir))
    assert events.EventTail(str(run_dir)).read() == []
    att = run_dir / "attempts" / "0"
    att.mkdir(parents=True)
    (att / "peer_failed").symlink_to(target)
    os.environ[events.ENV_RUN_DIR], os.environ[events.ENV_ATTEMPT] = str(run_dir), "0"
    try:
        assert events.peer_failed() is None
    finally:
        del os.environ[events.ENV_RUN_DIR], os.environ[events.ENV_ATTEMPT]


def test_beacon_and_stack_files_are_private(tmp_path):
    """issue 20 item 4: beacons and stack-dump files were created with the umask's mode."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    code = "from unbroken.elastic import heartbeat; heartbeat.beat(1)"
    env = dict(os.environ, **{events.ENV_RUN_DIR: str(run_dir), events.ENV_ATTEMPT: "0"})
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    (b,) = heartbeat.read_beats(str(run_dir), 0)
    assert stat.S_IMODE(os.stat(b.path).st_mode) == 0o600
    (dump,) = os.listdir(heartbeat.stack_dir(str(run_dir)))
    assert (
        stat.S_IMODE(os.stat(os.path.join(heartbeat.stack_dir(str(run_dir)), dump)).st_mode)
        == 0o600
    )
    for d in ("beats", "beats/a0", "stacks"):
        assert stat.S_IMODE(os.stat(run_dir / d).st_mode) == 0o700, d


def test_stack_dump_requests_reach_only_the_attempts_processes(tmp_path):
    """issue 20 item 4: a planted beacon made an arbitrary pid get SIGUSR2 (whose default
    action ends a process)."""
    victim = subprocess.Popen(["sleep", "300"])
    try:
        rec = heartbeat.BeatRecord("planted.beat", victim.pid, 0, 0, 1, 5, 1.0)
        got = heartbeat.request_stack_dumps(
            str(tmp_path), [rec], 0.1, ("UNBROKEN_ATTEMPT_TOKEN", "x")
        )
        assert got == [] and victim.poll() is None and is_alive(victim.pid)
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_the_storage_probe_never_writes_through_a_planted_name(tmp_path, plant):
    """issue 20 item 4: the pre-flight probe's fixed name ``.unbroken-probe-<node>`` was
    opened with O_TRUNC through whatever sat there (a symlink, a hard link)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    name = ckpt / ".unbroken-probe-nodeA"
    if plant == "symlink":
        name.symlink_to(target)
    else:
        os.link(target, name)
    cfg = preflight.PreflightConfig(ckpt_dir=str(ckpt), node="nodeA", gpus=0)
    results = preflight.run_preflight(cfg)
    assert all(r.ok for r in results), results
    assert target.read_bytes() == b"keep me"
    assert not name.exists() and not name.is_symlink()  # the probe cleaned up after itself


def test_an_error_file_named_by_the_console_is_read_only_inside_the_log_dir(tmp_path):
    """issue 20 item 4: torchrun's console carries the workers' own output, so the
    ``error_file:`` path of a failure block in it is only a claim: a file outside the
    attempt's log directory is not read into the stop report."""
    from unbroken.elastic.faults import collect_worker_failures

    outside = tmp_path / "secret.json"
    outside.write_text('{"message": {"message": "the secret", "extraInfo": {}}}')
    log_dir = tmp_path / "torchelastic"
    log_dir.mkdir()
    console = (
        "Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : h\n"
        f"  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 5)\n  error_file: {outside}\n"
    )
    (f,) = collect_worker_failures(console, str(log_dir))
    assert "secret" not in f.message


def test_the_events_log_read_refuses_a_fifo_a_symlink_and_a_directory_by_name(tmp_path):
    """The run directory is private, but what is in it is still untrusted: a FIFO in the
    events log's place must not block the supervisor, a symlink is not followed, a directory
    is named (it was "Is a directory: 3")."""
    import os

    import pytest

    from unbroken.common.events import EVENTS_FILE, load_events

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    log = run / EVENTS_FILE
    target = tmp_path / "elsewhere.jsonl"
    target.write_text('{"event": "launch", "t": 1, "attempt": 7}\n')
    for plant in (lambda: os.mkfifo(log), lambda: os.symlink(target, log), lambda: log.mkdir()):
        plant()
        with pytest.raises(OSError) as e:
            load_events(str(run))
        assert str(log) in str(e.value), e.value
        (log.rmdir if log.is_dir() and not log.is_symlink() else log.unlink)()
