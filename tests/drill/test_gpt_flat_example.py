"""Adoption of the most copied LLM training script (issue 21, "How to show it").

``examples/gpt_flat/train.py`` is the nanoGPT-style ``train_stock.py`` beside it plus at most
20 changed lines (tests/unit/test_adoption_diff.py): a flat ``uint16`` ``train.bin`` read in
place as random windows, the next batch fetched before the backward pass and held across the
save, ``best_val_loss`` a saved value, evaluation from streams of its own, DDP over gloo.
Under ``unbroken run --nproc-per-node 2`` a SIGKILL of each kind of process of rank 1 (the
worker, the per-rank launcher) is recovered and the run ends bit-identical to an
uninterrupted ``torchrun``; ``unbroken drill --multi-rank`` passes with the sample ids
compared; the same drill on a planted bug fails and names the real cause in its first line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from unbroken.ckpt.compare import compare_runs
from unbroken.cli import main
from unbroken.common.events import ENV_RUN_DIR, load_events
from unbroken.common.metrics import read_metrics
from unbroken.common.procs import environ_of
from unbroken.elastic import heartbeat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt_flat")
SCRIPT = os.path.abspath(os.path.join(HERE, "train.py"))
STOCK = os.path.abspath(os.path.join(HERE, "train_stock.py"))
ITERS = 30  # iterations 0..30: the final checkpoint is step 31, the periodic ones 10, 20, 30
DRILL_ITERS = 40  # the drill places a fault between checkpoints: it needs at least 33 steps
WORDS = "the of and to in a is that for it as was with be by on not he this are or his".split()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """nanoGPT's character-level layout (prepare.py), indexed in place for unbroken."""
    d = tmp_path_factory.mktemp("gpt-flat")
    r = random.Random(0)
    (d / "corpus.txt").write_text(" ".join(r.choice(WORDS) for _ in range(12000)))
    out = str(d / "data")
    prep = os.path.join(HERE, "prepare.py")
    subprocess.run(
        [sys.executable, prep, "--input", str(d / "corpus.txt"), "--out", out], check=True
    )
    for split in ("train", "val"):
        args = ["data", "index", f"{out}/{split}.bin", "--meta", f"{out}/meta.pkl"]
        assert main(args) == 0
    return out


def _args(data: str, out: str, iters: int = ITERS) -> list[str]:
    return [
        "--data-dir",
        data,
        "--out-dir",
        out,
        "--max-iters",
        str(iters),
        "--eval-interval",
        "10",
    ]


def _torchrun(nproc: int, script: str, args: list[str], log: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    with open(log, "wb") as out:
        rc = subprocess.run(
            [*cmd, "--nproc-per-node", str(nproc), script, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=HERE,
            timeout=400,
        ).returncode
    assert rc == 0, open(log, encoding="utf-8", errors="replace").read()[-3000:]


@pytest.fixture(scope="module")
def reference(data: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The adopted script, uninterrupted, on 2 ranks under plain torchrun."""
    ref = str(tmp_path_factory.mktemp("gpt-flat-ref") / "ref")
    _torchrun(2, SCRIPT, _args(data, ref), ref + ".log")
    return ref


def test_the_stock_script_runs(data, tmp_path):
    """The "before" is a real script, not a straw man: it trains under torchrun as it is."""
    out = str(tmp_path / "stock")
    _torchrun(2, STOCK, _args(data, out, 3), out + ".log")


def _wait(pred, what: str, proc: subprocess.Popen, timeout: float = 300) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        assert proc.poll() is None, f"the supervisor exited {proc.returncode} waiting for {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _victim(sup: str, kind: str) -> int:
    attempt = max(int(e["attempt"]) for e in load_events(sup) if e["event"] == "launch")
    worker = next(b for b in heartbeat.read_beats(sup, attempt) if b.rank == 1).pid
    if kind == "worker":
        return worker
    # the per-rank launcher: the process torchrun started for rank 1 (RANK=1, argv names
    # train.py), which is not the worker itself
    with open(f"/proc/{worker}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid not in (worker, parent) and environ_of(pid).get("RANK") == "1":
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"train.py" in argv and environ_of(pid).get(ENV_RUN_DIR) == sup:
                return pid
    raise AssertionError("no per-rank launcher of rank 1 found")


@pytest.mark.parametrize("kind", ["worker", "launcher"])
def test_sigkill_of_each_process_of_rank_1_resumes_bit_identical(data, reference, tmp_path, kind):
    run, sup = str(tmp_path / "run"), str(tmp_path / "sup")
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--nproc-per-node", "2"]
    cmd += ["--run-dir", sup, "--backoff", "0.2", "--backoff-max", "1", "--hang-timeout", "120"]
    with open(str(tmp_path / "sup.out"), "wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--", SCRIPT, *_args(data, run)], stdout=out, stderr=subprocess.STDOUT, cwd=HERE
        )
        try:
            metrics = os.path.join(run, "metrics.jsonl")
            _wait(lambda: (read_metrics(metrics) or [{"step": 0}])[-1]["step"] >= 14, "14", proc)
            os.kill(_victim(sup, kind), signal.SIGKILL)
            rc = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 0, open(str(tmp_path / "sup.out"), errors="replace").read()[-3000:]
    events = load_events(sup)
    fails = [e for e in events if e["event"] == "failure"]
    assert len(fails) == 1 and fails[0]["fault"] == "process", fails
    # killed at step 14: resumed from step 10 - or from 20 when the orphaned rank 1 (its
    # launcher gone) trained on until torchrun stopped it, as a loaded box allows
    loaded = {int(e["step"]) for e in events if e["event"] == "loaded"}  # one per rank
    assert loaded in ([{10}] if kind == "worker" else [{10}, {20}]), loaded
    res = compare_runs(reference, run)
    assert res["identical"], res
    assert res["ids_logged"] and res["duplicated_steps"] == 0
    rows = read_metrics(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, ITERS + 2))
    assert all(len(r["ids"]) == 16 for r in rows)  # the global batch: 2 ranks x 8 windows


def test_drill_multi_rank_passes_with_sample_ids_compared(data, tmp_path, capsys):
    out = str(tmp_path / "drill")
    rc = main(
        [
            "drill",
            "--multi-rank",
            "--faults",
            "world-size",  # a SIGKILL on 2 ranks: test_sigkill_of_each_process_of_rank_1
            "--dir",
            out,
            "--timeout",
            "400",
            "--may-differ",
            "values/best=evaluated on weights that round differently on another world size",
            "--",
            SCRIPT,
            *_args(data, "{dir}", DRILL_ITERS),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text[-4000:]
    report = json.load(open(os.path.join(out, "drill.json")))
    assert [f["verdict"] for f in report["faults"]] == ["PASS"], text
    for fault in report["faults"]:
        detail = {c["name"]: c for c in fault["checks"]}["trajectory"]["detail"]
        assert "sample ids" in detail, text
    assert "values/best" in text and "round differently" in text, text


PLANTED = {
    # the batch fetched after the forward pass is in no checkpoint
    "held batch": [("xy=True, held_batches=1)", "xy=True, held_batches=0)")],
    # dropout's stream starts afresh after the restore
    "rng": [("state = TrainState(", "state = TrainState(capture_rng=False, ")],
    # the step counter starts at 0 again: the log is refused
    "restore ignored": [
        (
            "iter_num, best_val_loss = ckpt.restore() or 0,",
            "ckpt.restore()\niter_num, best_val_loss = 0,",
        )
    ],
}
CAUSE = {
    "held batch": "other samples",
    "rng": "rng",
    "restore ignored": "metric step 1 is before the last logged step",
}


@pytest.fixture(scope="module")
def planted(data, tmp_path_factory):
    """The single-node SIGKILL drill on each planted bug, side by side."""
    base = tmp_path_factory.mktemp("gpt-flat-planted")
    src = open(SCRIPT, encoding="utf-8").read()

    def one(bug: str) -> tuple[int, str, str]:
        text = src
        for old, new in PLANTED[bug]:
            assert text.count(old) == 1, (bug, old)
            text = text.replace(old, new)
        script = os.path.join(HERE, f"_planted_{bug.replace(' ', '_')}_{os.getpid()}.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            out = str(base / bug.replace(" ", "-"))
            log = out + ".txt"
            cmd = [sys.executable, "-m", "unbroken.cli", "drill", "--faults", "kill"]
            cmd += [
                "--dir",
                out,
                "--timeout",
                "400",
                "--",
                script,
                *_args(data, "{dir}", DRILL_ITERS),
            ]
            with open(log, "wb") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE).returncode
            return rc, open(log, encoding="utf-8", errors="replace").read(), out
        finally:
            os.unlink(script)

    with ThreadPoolExecutor(len(PLANTED)) as pool:
        return dict(zip(PLANTED, pool.map(one, PLANTED), strict=True))


@pytest.mark.parametrize("bug", list(PLANTED))
def test_the_drill_fails_a_planted_bug_and_names_it_first(planted, bug):
    rc, text, out = planted[bug]
    assert rc == 1, text[-4000:]
    head = open(os.path.join(out, "drill.txt"), encoding="utf-8").read().splitlines()[0]
    assert "FAIL" in head and CAUSE[bug] in head, head
