"""A new user walking README.md with the real `unbroken` command: what the README's
"Command line" section promises matches `--help`, and the mistakes a user makes first (a
wrong option value, the wrong file, a directory of their own) get one line that names the
option, the value and the fix - and lose nothing."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from datakit import S3_TEST_CREDS
from storekit import moto_endpoint
from unbroken.cli import build_parser, main

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _readme_section(title: str) -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _subparser(path: list[str]) -> argparse.ArgumentParser:
    p = build_parser()
    for name in path:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        p = subs[0].choices[name]
    return p


def _table_rows() -> list[tuple[list[str], set[str]]]:
    """(command path, flags) of each row of README's command table."""
    rows = []
    for line in _readme_section("Command line").splitlines():
        m = re.match(r"\| `unbroken ((?:[a-z]+ ?)+)(.*?)` \|", line)
        if m:
            path = m.group(1).split()
            rows.append((path, set(re.findall(r"--[a-z][a-z0-9-]*", m.group(2)))))
    return rows


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_every_option_readme_documents_is_an_option_of_that_command() -> None:
    rows = _table_rows()
    assert len(rows) >= 18, rows
    for path, flags in rows:
        have = {s for a in _subparser(path)._actions for s in a.option_strings}
        assert flags <= have, f"unbroken {' '.join(path)}: README documents {flags - have}"


def test_help_lists_every_exit_code_readme_lists() -> None:
    codes = re.findall(r"^\| (\d+(?:-\d+)?) \|", _readme_section("Command line"), re.M)
    wanted = set()
    for c in codes:
        lo, _, hi = c.partition("-")
        wanted |= set(range(int(lo), int(hi or lo) + 1))
    assert wanted == {0, 1, 2, 3, 4, 5, 6, 7, 8, 130}
    epilog = build_parser().epilog or ""
    said = {
        int(n) for n in re.findall(r"(?:^|\s|,\s)(\d+)\s+[a-z]", epilog.split("exit codes:")[1])
    }
    assert wanted <= said, f"`unbroken --help` does not explain exit codes {wanted - said}"


def test_demo_refuses_a_directory_holding_files_it_did_not_write(tmp_path, capsys) -> None:
    """`unbroken demo --dir D` empties D first: a user's own directory must survive it."""
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "train.py").write_text("precious")
    assert main(["demo", "--dir", str(mine), "--steps", "20"]) == 2
    err = _err(capsys)
    assert (mine / "train.py").read_text() == "precious"
    assert "--dir" in err and str(mine) in err and "train.py" in err and "new directory" in err
    # a directory of one's own that holds only `data/` is not a demo's either
    (mine / "train.py").unlink()
    (mine / "data").mkdir()
    assert main(["demo", "--dir", str(mine), "--steps", "20"]) == 2
    assert "data" in _err(capsys) and (mine / "data").is_dir()
    # an earlier demo's directory is fine (the step count is refused after that check,
    # before anything is removed)
    demo = tmp_path / "demo-run"
    for d in ("data", "reference", "killed"):
        (demo / d).mkdir(parents=True)
    assert main(["demo", "--dir", str(demo), "--steps", "0"]) == 2
    assert "steps=0" in _err(capsys) and (demo / "data").is_dir()


@pytest.mark.parametrize("cmd", ["preflight", "run"])
def test_a_malformed_endpoint_is_bad_input_naming_the_option(cmd, capsys) -> None:
    with pytest.raises(SystemExit) as e:  # argparse: its usage, then one error line
        main([cmd, "--rdzv-endpoint", "nonsense", *(["--", "train.py"] if cmd == "run" else [])])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "--rdzv-endpoint" in err and "'nonsense'" in err
    assert "HOST:PORT" in err


def test_preflight_with_nothing_to_check_says_what_to_pass(capsys) -> None:
    assert main(["preflight"]) == 2
    err = _err(capsys)
    assert "nothing to check" in err and "--ckpt-dir" in err


def test_min_free_bytes_takes_a_size_like_every_other_size_option(tmp_path, capsys) -> None:
    d = str(tmp_path / "c")
    assert main(["preflight", "--ckpt-dir", d, "--min-free-bytes", "1KiB"]) == 0
    assert "ok    ckpt_dir" in capsys.readouterr().out
    assert main(["preflight", "--ckpt-dir", d, "--min-free-bytes", "1000000TB"]) == 1
    assert "FAIL  ckpt_dir" in capsys.readouterr().out


def test_a_bad_fault_rule_regex_names_the_option(capsys) -> None:
    assert main(["run", "--fault-rule", "process=(", "--", "train.py"]) == 2
    err = _err(capsys)
    assert "--fault-rule 'process=('" in err and "regex" in err


def _flat(tmp_path, dtype=np.uint32) -> str:
    path = str(tmp_path / "train.bin")
    np.arange(4096, dtype=dtype).tofile(path)
    return path


def test_index_of_a_flat_file_needs_its_vocabulary_or_width(tmp_path, capsys) -> None:
    """A uint32 file indexed as the default uint16 would hand the loop every token split in
    two; README's synopsis requires --meta or --vocab-size, and so does the command."""
    path = _flat(tmp_path)
    assert main(["data", "index", path]) == 2
    err = _err(capsys)
    assert path in err and "--meta" in err and "--vocab-size" in err and "--dtype" in err
    assert not os.path.exists(path + ".idx")
    assert main(["data", "index", path, "--dtype", "uint32"]) == 0
    assert os.path.exists(path + ".idx")


def test_index_with_a_missing_meta_names_the_option_and_the_fix(tmp_path, capsys) -> None:
    path = _flat(tmp_path)
    assert main(["data", "index", path, "--meta", str(tmp_path / "meta.pkl")]) == 2
    err = _err(capsys)
    assert "--meta" in err and "meta.pkl" in err and "--vocab-size" in err


def test_tokenize_of_a_flat_token_file_without_from_bin_says_from_bin(tmp_path, capsys) -> None:
    path = _flat(tmp_path, np.uint16)
    assert main(["data", "index", path, "--vocab-size", "5000"]) == 0
    capsys.readouterr()
    out = str(tmp_path / "tok")
    assert main(["data", "tokenize", path, out, "--train-bpe", "300"]) == 2
    err = _err(capsys)
    assert path in err and "--from-bin" in err and "UnicodeDecodeError" not in err
    assert not os.path.exists(out)


@pytest.mark.timeout(120)
def test_an_s3_command_prints_one_line_not_the_sdks_info(tmp_path) -> None:
    """The CLI logs unbroken's INFO, not botocore's credential lookups on every S3 call."""
    with moto_endpoint() as ep:
        env = {**os.environ, **S3_TEST_CREDS, "AWS_ENDPOINT_URL": ep}
        cmd = [sys.executable, "-m", "unbroken.cli", "data", "stage", "s3://nob/tok"]
        r = subprocess.run(
            [*cmd, str(tmp_path / "x")], env=env, capture_output=True, text=True, timeout=100
        )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unbroken: error: s3://nob/tok"), lines


def test_every_command_readme_spells_is_a_command_of_this_release() -> None:
    """README's commands, in prose and in code blocks: no old spelling (`unbroken stage`
    prints a deprecation note), no command that does not exist."""
    with open(README, encoding="utf-8") as f:  # less the sentence about the old spellings
        text = re.sub(r"The old spellings `[^`]*`", "", f.read())
    spelled = re.findall(r"`unbroken ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", text)
    spelled += re.findall(r"^\s*unbroken ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", text, re.M)
    top = _subs_of([])
    assert len(spelled) > 40
    for cmd, sub in spelled:
        if cmd in ("trusts",):  # prose: "What unbroken trusts"
            continue
        assert cmd in top, f"README spells `unbroken {cmd}`: no such command"
        if cmd in ("data", "ckpt") and sub:
            assert sub in _subs_of([cmd]), f"README spells `unbroken {cmd} {sub}`"


def _subs_of(path: list[str]) -> set[str]:
    p = _subparser(path)
    return set([a for a in p._actions if isinstance(a, argparse._SubParsersAction)][0].choices)


def test_verify_deep_help_says_what_it_rechecks() -> None:
    """README: --deep re-checks every tensor's own checksum (manifest v4) or statistics."""
    deep = [a for a in _subparser(["ckpt", "verify"])._actions if "--deep" in a.option_strings]
    assert "checksum" in (deep[0].help or "") and "v4" in (deep[0].help or "")


def _bullet(text: str, start: str) -> str:
    """The README paragraph (bullet) that starts with ``start``."""
    i = text.index(start)
    return text[i : text.find("\n* ", i + 1) if "\n* " in text[i:] else len(text)]


@pytest.mark.parametrize(
    "start,config",
    [
        ("* **Options**", "unbroken.ckpt.config:CheckpointConfig"),
        ("* **Options**", "unbroken.ckpt:ArchiveConfig"),
        ("The loader's\noptions live in", "unbroken.data.stream.config:LoaderConfig"),
    ],
)
def test_readme_option_lists_name_every_field_of_their_config(start, config) -> None:
    import dataclasses
    import importlib

    mod, _, name = config.partition(":")
    cls = getattr(importlib.import_module(mod), name)
    with open(README, encoding="utf-8") as f:
        para = _bullet(f.read(), start)
    missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in para]
    assert not missing, f"README's list of {name} options lacks {missing}"


@pytest.mark.parametrize("flag", ["--reference", "--reference-w2"])
def test_drill_reference_that_is_not_a_directory_names_the_option(flag, tmp_path, capsys):
    """A mistyped --reference was read as a run that logged nothing."""
    missing = str(tmp_path / "no-such-run")
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["drill", "--dir", str(tmp_path / "d"), flag, missing, "--", str(script), "{dir}"]
    assert main(argv) == 2
    err = _err(capsys)
    assert f"{flag} {missing}" in err and "no such directory" in err and "reference-w" in err
    assert not os.path.exists(tmp_path / "d")


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["data", "pack", "in.jsonl", "out", "--workers", "0"], "--workers"),
        (["data", "index", "shards", "--workers", "0"], "--workers"),
        (
            ["data", "tokenize", "in.jsonl", "out", "--train-bpe", "300", "--workers", "0"],
            "--workers",
        ),
        (["data", "tokenize", "in.jsonl", "out", "--seq-len", "-3"], "--seq-len"),
        (["data", "stage", "src", "dst", "--workers", "0"], "--workers"),
        (["data", "inspect", "d", "--epochs", "0"], "--epochs"),
        (["data", "inspect", "d", "--seq-len", "0"], "--seq-len"),
        (["data", "inspect", "d", "--shuffle-window", "0"], "--shuffle-window"),
        (["data", "bench", "d", "--batch-size", "0"], "--batch-size"),
        (["data", "bench", "d", "--num-workers", "-1"], "--num-workers"),
        (["data", "bench", "d", "--batches", "1"], "--batches"),
        (["data", "report", "r", "--num-workers", "0"], "--num-workers"),
        (["run", "--nproc-per-node", "0", "--", "train.py"], "--nproc-per-node"),
        (["run", "--max-restarts", "-1", "--", "train.py"], "--max-restarts"),
        (["preflight", "--nproc-per-node", "-1"], "--nproc-per-node"),
        (["drill", "--ckpt-every", "0", "--", "train.py", "{dir}"], "--ckpt-every"),
    ],
)
def test_a_count_out_of_range_is_refused_naming_its_option(
    argv, flag, tmp_path, capsys, monkeypatch
):
    """Each was accepted (`tokenize --workers 0` ran) or refused naming the library's keyword
    (`nproc_per_node=0`) instead of the option the user typed."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and f"argument {flag}" in err, err


def _readme_command_lines(verb: str) -> list[str]:
    """Lines of README's code blocks that run ``unbroken VERB`` (comments cut)."""
    with open(README, encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    lines = [ln.split("#")[0].strip() for b in blocks for ln in b.splitlines()]
    return [ln for ln in lines if ln.startswith(f"unbroken {verb} ")]


def test_readme_run_commands_make_a_valid_supervisor_config() -> None:
    """What the user copies from README must get past the config's own checks (the first
    example asked for --nnodes 1:2 without the fixed rendezvous port that needs)."""
    import shlex

    from unbroken.cli.elastic import run_config

    lines = _readme_command_lines("run")
    assert lines
    for ln in lines:
        run_config(build_parser().parse_args(shlex.split(ln)[1:]))


def _one_checkpoint(root: str) -> None:
    import torch

    from unbroken.ckpt import Checkpointer, TrainState

    m = torch.nn.Linear(4, 2)
    st = TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    st.step = 1
    ck = Checkpointer(root, st, quiet=True)
    ck.save()
    ck.close()


def test_export_to_a_directory_or_into_the_checkpoint_says_where_to_write(tmp_path, capsys):
    """`--to DIR` failed after the whole read, naming a temporary file; `--to` inside the
    root wrote into a committed step, which `ckpt verify` then still called intact."""
    root = str(tmp_path / "ckpt")
    _one_checkpoint(root)
    assert main(["ckpt", "export", root, "--to", str(tmp_path)]) == 2
    err = _err(capsys)
    assert f"--to {tmp_path}" in err and "is a directory" in err and ".safetensors" in err
    inside = os.path.join(root, "step-00000001", "model.safetensors")
    assert main(["ckpt", "export", root, "--to", inside]) == 2
    err = _err(capsys)
    assert "--to" in err and "inside the checkpoint root" in err
    assert not os.path.exists(inside)


def test_python_dash_m_unbroken_is_the_unbroken_command() -> None:
    """`python -m unbroken` works where the console script is not on PATH (a venv not
    activated, a container with only the interpreter)."""
    out = subprocess.run(
        [sys.executable, "-m", "unbroken", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: unbroken") and "exit codes:" in out.stdout


@pytest.mark.parametrize("verb", ["run", "drill"])
@pytest.mark.parametrize("first", ["python", "python3.11", "interpreter"])
def test_a_python_interpreter_before_the_script_is_refused_with_the_command_to_type(
    verb, first, tmp_path, capsys, monkeypatch
):
    """`unbroken run -- python train.py` (the habit of `accelerate launch` users): torchrun
    runs the script with Python itself, so it tried to run the interpreter as Python source
    (a venv's python: "SyntaxError: source code cannot contain null bytes" from every
    worker, restarted by the policy). Refused before any process starts, with the command
    without it."""
    import sys

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    prog = sys.executable if first == "interpreter" else first
    extra = ["{dir}"] if verb == "drill" else []
    assert main([verb, "--", prog, "train.py", *extra]) == 2
    err = capsys.readouterr().err
    assert "a program, not a Python script" in err and "-- train.py ARGS" in err, err
