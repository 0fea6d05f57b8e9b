"""The examples/ a new user runs first, run as their docstrings say: the README's loop started
again after it finished (what a restart after a kill at the end does), and the stock DDP
loop into an output directory that does not exist yet."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_train_resumable_started_again_after_its_last_step_exits_cleanly(tmp_path, capsys):
    """Killed after its final checkpoint (or simply run twice), the restart restores the last
    step, trains no step, and must still finish - not die on the loss it never computed."""
    example = _load("train_resumable")
    run = str(tmp_path / "run")
    example.main(run, steps=50)
    example.main(run, steps=50)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "done at step 50", out


@pytest.mark.timeout(120)
def test_ddp_stock_writes_into_an_output_directory_it_creates(tmp_path):
    """Its docstring's `torchrun ... examples/ddp_stock.py --data corpus.txt --out run`
    (env:// rendezvous of one rank, as torchrun sets it)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        # the one rank's store binds a free port itself: a port found free here and closed
        # could be taken by another test's store before the run binds it
        "MASTER_PORT": "0",
    }
    out = tmp_path / "run"
    script = os.path.join(EXAMPLES, "ddp_stock.py")
    args = ["--data", str(corpus), "--out", str(out), "--steps", "2"]
    # CI once saw this 2-step run time out at 100 s with nothing said: a stuck run is sent
    # SIGABRT, on which faulthandler prints every thread's stack (the failure shows where).
    env["PYTHONFAULTHANDLER"] = "1"
    p = subprocess.Popen(
        [sys.executable, script, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _, err = p.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)
        _, err = p.communicate(timeout=10)
    said = err.decode(errors="replace")[-6000:]
    assert p.returncode == 0, f"exit status {p.returncode}:\n{said}"
    assert (out / "model.pt").is_file()


@pytest.mark.timeout(240)
def test_gpt_flat_started_again_after_its_last_step_trains_no_step_more(tmp_path):
    """nanoGPT tests `iter_num > max_iters` after the step: restored from its final
    checkpoint, it trained (and saved) one step more on every restart, so a restart after
    the final save ended elsewhere than the uninterrupted run."""
    from unbroken.cli import main

    data, out = tmp_path / "data", tmp_path / "out"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    gpt = os.path.join(EXAMPLES, "gpt_flat")
    prep = [os.path.join(gpt, "prepare.py"), "--input", str(corpus), "--out", str(data)]
    subprocess.run([sys.executable, *prep], check=True, capture_output=True, timeout=60)
    for split in ("train", "val"):
        assert main(["data", "index", f"{data}/{split}.bin", "--meta", f"{data}/meta.pkl"]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    argv = [os.path.join(gpt, "train.py"), "--data-dir", str(data), "--out-dir", str(out)]
    argv += ["--max-iters", "4", "--eval-interval", "100", "--eval-iters", "1"]
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=100
        )
        assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(out / "ckpt")) == ["step-00000005"]
