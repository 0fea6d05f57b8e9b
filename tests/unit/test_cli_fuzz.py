"""Every verb of `unbroken` meets bad input - missing and wrong paths, nonsense values - with
exit 2 and one error line, never a traceback (issue 12 item 11).

The verbs come from the parser itself, so a verb added later is fuzzed too (a verb without a
base case below fails the test). Cases run in-process through ``unbroken.cli.main``; a few go
through a real ``unbroken`` subprocess, to see what a user sees. Seeded: the same cases every
run."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys

import pytest

from unbroken import cli

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

_NONSENSE = ("-7", "0", "nan", "1e400", "abc", "", "../../../../etc", "\x00x")


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sp in subs[0].choices.items():
        yield from _leaves(sp, (*path, name))


@pytest.fixture(scope="module")
def places(tmp_path_factory, stream_data):
    t = tmp_path_factory.mktemp("cli-fuzz")
    junk = t / "junk.txt"
    junk.write_bytes(b"\x00\xffnot what you think\n")
    (t / "empty").mkdir()
    bad_jsonl = t / "bad.jsonl"
    bad_jsonl.write_text('{"text": "a b"}\nnot json\n')
    return {
        "missing": str(t / "does-not-exist"),
        "junk": str(junk),
        "empty": str(t / "empty"),
        "bad_jsonl": str(bad_jsonl),
        "tar": stream_data("tar"),
        "tokens": stream_data("tokens"),
        "out": str(t / "out"),
        "t": str(t),
    }


def _bases(p: dict[str, str]) -> dict[tuple[str, ...], list[list[str]]]:
    """Per verb: argument lists that must fail as bad input (wrong/missing paths)."""
    m, j, e = p["missing"], p["junk"], p["empty"]
    return {
        ("demo",): [["--dir", j, "--steps", "2"]],
        ("ckpt", "ls"): [[m], [j], [m, "--archive", m]],
        ("ckpt", "inspect"): [[m], [j], [e, "--step", "-3"]],
        ("ckpt", "verify"): [[m], [j]],
        ("ckpt", "export"): [[m, "--to", p["out"] + ".st"], [j, "--to", j]],
        ("data", "inspect"): [[m], [j], [e], [p["tar"], "--epochs", "-1"]],
        ("data", "bench"): [[m], [j], [p["tar"], "--transform", "no.such:thing"]],
        ("data", "report"): [[m], [j], [e]],
        ("run",): [["--run-dir", p["out"], "--", m], ["--run-dir", j, "--", m]],
        ("preflight",): [["--rdzv-endpoint", "not-a-host-port"]],
        ("report",): [[m], [j], [e]],
        ("plan",): [["--run-dir", m], ["--mtbf", "-1", "--ckpt-cost", "3"], []],
        ("data", "pack"): [
            [m, p["out"]],
            [p["bad_jsonl"], p["out"]],
            [p["bad_jsonl"], j],
            [e, p["out"]],
        ],
        ("data", "index"): [[m], [j], [e]],
        ("data", "tokenize"): [
            [m, p["out"], "--train-bpe", "300"],
            [j, p["out"], "--tokenizer", j],
        ],
        ("data", "stage"): [[m, p["out"]], [j, p["out"]], [p["tar"], j]],
        ("drill",): [["--dir", p["out"], "--", m, "{dir}"], ["--dir", j, "--example"]],
    }


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse refusing a value: its usage + one error line
        rc = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    return rc, out, err


def _check(argv: list[str], rc: int, out: str, err: str) -> None:
    where = f"unbroken {' '.join(map(repr, argv))}"
    assert "Traceback" not in out + err, f"{where}: traceback\n{err[-3000:]}"
    if argv[0] == "preflight" and rc == 1:
        # its contract: a table of checks, exit 1 when one fails (bad values fail their check)
        assert "FAIL" in out, f"{where}: exit 1 without a failed check\n{out}"
        return
    assert rc == 2, f"{where}: exit {rc}, want 2 (bad input)\n{out[-500:]}\n{err[-1500:]}"
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, f"{where}: want one error line, got {errors}"


def test_every_verb_refuses_bad_paths_and_nonsense_values(places, capsys, monkeypatch):
    monkeypatch.chdir(places["t"])
    bases = _bases(places)
    leaves = {path: sp for path, sp in _leaves(cli.build_parser())}
    assert set(leaves) == set(bases), f"verbs without fuzz cases: {set(leaves) - set(bases)}"
    rng = random.Random(12)
    n = 0
    for path, sp in leaves.items():
        for base in bases[path]:
            argv = [*path, *base]
            _check(argv, *_run(argv, capsys))
            n += 1
            # every option once, with a nonsense value, on top of the failing base
            for a in sp._actions:
                if not a.option_strings or a.nargs == 0 or a.dest == "help":
                    continue
                value = rng.choice(_NONSENSE)
                # before the base's "--" (what follows it is the training command)
                k = base.index("--") if "--" in base else 0
                argv = [*path, *base[:k], a.option_strings[-1], value, *base[k:]]
                _check(argv, *_run(argv, capsys))
                n += 1
    assert n > 150


def _good(p: dict[str, str]) -> dict[tuple[str, ...], list[str]]:
    """Per cheap verb: a valid command line, for fuzzing one option at a time on it."""
    return {
        ("data", "inspect"): [p["tar"], "--epochs", "1"],
        ("plan",): ["--mtbf", "3600", "--ckpt-cost", "30"],
        ("data", "pack"): [p["bad_jsonl"], p["out"] + "/pk", "--skip-bad", "--no-progress"],
        ("data", "index"): [p["out"] + "/pk"],
        ("data", "stage"): [p["tar"], p["out"] + "/st", "--no-progress"],
        ("ckpt", "ls"): [p["empty"]],
    }


def test_nonsense_values_on_valid_command_lines(places, capsys, monkeypatch):
    """Each option of the cheap verbs, with each nonsense value, on an otherwise valid
    command line: either accepted (exit 0) or refused with exit 2 and one line."""
    monkeypatch.chdir(places["t"])
    leaves = {path: sp for path, sp in _leaves(cli.build_parser())}
    n = 0
    for path, good in _good(places).items():
        rc, out, err = _run([*path, *good], capsys)
        assert rc == 0 and "Traceback" not in err, f"{path}: valid line failed: {err}"
        for a in leaves[path]._actions:
            if not a.option_strings or a.nargs == 0 or a.dest == "help":
                continue
            for value in _NONSENSE:
                argv = [*path, *good, a.option_strings[-1], value]
                rc, out, err = _run(argv, capsys)
                n += 1
                if rc != 0:
                    _check(argv, rc, out, err)
                else:
                    assert "Traceback" not in out + err, argv
    assert n > 100


def test_unknown_verb_and_missing_arguments_are_usage_errors(capsys):
    for argv in (["nope"], ["ckpt"], ["data"], ["pack"], ["ckpt", "export", "x"], []):
        rc, out, err = _run(argv, capsys)
        assert rc == 2 and "Traceback" not in err and "error:" in err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["data", "pack", "{bad_jsonl}", "{out}/p", "--no-progress"],
            "bad.jsonl:2: not a JSON line",
        ),
        # a file is a flat token file since issue 21 (data index FILE.bin): refused by its size
        (
            ["data", "index", "{junk}", "--dtype", "uint16"],
            "is not a whole number of uint16 tokens",
        ),
        (["run", "--run-dir", "{out}/r", "--", "{missing}"], "does-not-exist"),
    ],
)
def test_real_process_exits_2_with_one_line(places, argv, needle):
    argv = [a.format(**places) for a in argv]
    exe = os.path.join(os.path.dirname(sys.executable), "unbroken")
    r = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("unbroken: error:") and needle in lines[-1], r.stderr
