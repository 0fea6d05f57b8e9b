"""Adoption as a test: ``examples/ddp_unbroken.py`` (the stock DDP loop of
``examples/ddp_stock.py`` plus < 30 changed lines) runs under ``unbroken run
--nproc-per-node 2``, survives a SIGKILL of one rank bit for bit, and passes
``unbroken drill --multi-rank`` (2 ranks -> 1 rank after a lost node)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from unbroken.ckpt.compare import compare_runs
from unbroken.cli import main
from unbroken.common.events import load_events
from unbroken.common.metrics import read_metrics
from unbroken.elastic import heartbeat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
SCRIPT = os.path.abspath(os.path.join(EXAMPLES, "ddp_unbroken.py"))
STOCK = os.path.abspath(os.path.join(EXAMPLES, "ddp_stock.py"))
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from "
    "at which but have an they you were her she there been one all we their has"
).split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(corpus.txt, its token shards made by `unbroken data tokenize`: 392 sequences of 33)."""
    d = tmp_path_factory.mktemp("ddp-data")
    r = random.Random(0)
    text = " ".join(r.choice(WORDS) + ("." if r.random() < 0.08 else "") for _ in range(12000))
    (d / "corpus.txt").write_text(text)
    tok = str(d / "tok")
    assert (
        main(
            [
                "data",
                "tokenize",
                str(d / "corpus.txt"),
                tok,
                "--train-bpe",
                "512",
                "--seq-len",
                "32",
            ]
        )
        == 0
    )
    return str(d / "corpus.txt"), tok


def _torchrun(nproc: int, *args: str, log: str, timeout: float = 240) -> None:
    with open(log, "wb") as out:
        rc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        ).returncode
    assert rc == 0, open(log, encoding="utf-8", errors="replace").read()[-3000:]


def test_the_stock_loop_runs(corpus, tmp_path):
    """The "before" is a real loop, not a straw man: it trains under torchrun as it is."""
    text, _ = corpus
    _torchrun(
        1,
        STOCK,
        "--data",
        text,
        "--out",
        str(tmp_path),
        "--steps",
        "3",
        log=str(tmp_path / "stock.log"),
    )
    assert (tmp_path / "model.pt").stat().st_size > 0


def _wait(pred, what: str, proc: subprocess.Popen, timeout: float = 240) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        assert proc.poll() is None, f"the supervisor exited {proc.returncode} waiting for {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def drill(corpus, world_size_drill) -> tuple[int, str, str]:
    """The multi-rank drill on the example, run once: (exit code, console, directory). Its
    2-rank reference (``reference-w2``) is also the SIGKILL test's: the same command."""
    _, tok = corpus
    command = [SCRIPT, *_args(tok), "--out", "{dir}"]
    return world_size_drill("ddp-drill", command, "--hang-timeout", "60", "--timeout", "300")


def _args(tok: str) -> list[str]:
    return ["--data", tok, "--steps", "40"]


def test_sigkill_of_one_rank_resumes_bit_identical(corpus, drill, tmp_path):
    _, tok = corpus
    args = _args(tok)
    # the drill's reference: ``torchrun --standalone --nproc-per-node 2 SCRIPT *args --out ref``
    ref = os.path.join(drill[2], "reference-w2")
    steps = [r["step"] for r in read_metrics(os.path.join(ref, "metrics.jsonl"))]
    assert steps == list(range(1, 41)), f"the drill's reference run did not finish: {drill[1]}"

    run, sup = str(tmp_path / "run"), str(tmp_path / "sup")
    cmd = [
        sys.executable,
        "-m",
        "unbroken.cli",
        "run",
        "--nproc-per-node",
        "2",
        "--run-dir",
        sup,
        "--backoff",
        "0.2",
        "--backoff-max",
        "1",
        "--hang-timeout",
        "120",
        "--",
        SCRIPT,
        *args,
        "--out",
        run,
    ]
    with open(str(tmp_path / "sup.out"), "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            metrics = os.path.join(run, "metrics.jsonl")
            _wait(
                lambda: (read_metrics(metrics) or [{"step": 0}])[-1]["step"] >= 25, "step 25", proc
            )
            attempt = max(int(e["attempt"]) for e in load_events(sup) if e["event"] == "launch")
            victim = next(b for b in heartbeat.read_beats(sup, attempt) if b.rank == 1)
            os.kill(victim.pid, signal.SIGKILL)  # rank 1: not the rank that writes the log
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 0, open(str(tmp_path / "sup.out"), errors="replace").read()[-3000:]
    events = load_events(sup)
    fails = [e for e in events if e["event"] == "failure"]
    assert len(fails) == 1 and fails[0]["fault"] == "process", fails
    loaded = {int(e["step"]) for e in events if e["event"] == "loaded"}
    assert loaded == {20}, loaded  # the newest checkpoint before step 25+, on both ranks
    res = compare_runs(ref, run)
    assert res["identical"], res
    assert res["ids_logged"] and res["duplicated_steps"] == 0
    steps = [r["step"] for r in read_metrics(os.path.join(run, "metrics.jsonl"))]
    assert steps == list(range(1, 41))
    # every step logs the whole global batch, in the order one rank would read it
    assert all(len(r["ids"]) == 16 for r in read_metrics(os.path.join(run, "metrics.jsonl")))


def test_drill_multi_rank_on_the_ddp_example(drill):
    rc, text, out = drill
    assert rc == 0, text[-4000:]
    report = json.load(open(os.path.join(out, "drill.json")))
    (fault,) = report["faults"]
    assert fault["spec"]["kind"] == "world-size" and fault["verdict"] == "PASS", text
    checks = {c["name"]: c for c in fault["checks"]}
    assert "sample ids of steps" in checks["trajectory"]["detail"], text
    run = {c["name"]: c for c in report["runs"][0]["checks"]}
    assert run["data order"]["ok"] and run["data order"]["detail"].startswith("identical"), text
