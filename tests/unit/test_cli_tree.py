"""The shape of the `unbroken` command (issue 15): one tree, an example per command that
parses, old spellings that still work with one deprecation line, exit codes by kind of
error, and flag defaults that are the config dataclasses' defaults."""

from __future__ import annotations

import argparse
import errno
import inspect
import shlex
from collections.abc import Callable
from typing import Any, cast

import pytest

from unbroken import __version__
from unbroken.cli import DEPRECATED, build_parser, exit_code, main
from unbroken.cli._args import config_default
from unbroken.cli.elastic import PREFLIGHT_FLAGS, RUN_FLAGS, preflight_config, run_config
from unbroken.common.errors import CheckFailed
from unbroken.elastic.preflight import PreflightConfig
from unbroken.elastic.supervisor import RunConfig

TREE = (
    {("data", c) for c in ("pack", "index", "tokenize", "stage", "inspect", "bench", "report")}
    | {("ckpt", c) for c in ("ls", "inspect", "verify", "export")}
    | {(c,) for c in ("run", "preflight", "report", "plan", "drill", "demo")}
)


def _subs(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    acts = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(acts[0].choices) if acts else {}


def _walk(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, p
    for name, sp in _subs(p).items():
        yield from _walk(sp, (*path, name))


def test_one_tree_each_command_with_a_purpose_and_an_example_that_parses() -> None:
    parser = build_parser()
    nodes = dict(_walk(parser))
    assert {path for path, p in nodes.items() if not _subs(p)} == TREE
    assert not set(DEPRECATED) & set(_subs(parser)), "old spellings are hidden from --help"
    for path, p in nodes.items():
        assert p.description and p.epilog, path
        assert not p.description.lower().startswith(("no logic", "parses")), path
        head, example = p.epilog.split("\n", 2)[:2]
        assert head == "example:" and example.startswith("  unbroken "), (path, p.epilog)
        argv = shlex.split(example)[1:]
        assert tuple(argv[: len(path)]) == path, (path, example)
        parser.parse_args(argv)  # exits 2 on an example that does not parse
        purpose = p.description.split("\n\n")[0]
        assert "\n" not in purpose and len(purpose) <= 100, f"{path}: purpose on one line"


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"unbroken {__version__}"


def test_old_spellings_work_with_one_deprecation_line(tmp_path, capsys) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert main(["pack", str(src), str(tmp_path / "d"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == ["unbroken: 'unbroken pack' is deprecated; use 'unbroken data pack'"]
    assert "2 samples" in out
    assert main(["-v", "index", str(tmp_path / "d")]) == 0  # after a global option too
    err = capsys.readouterr().err
    assert "'unbroken index' is deprecated; use 'unbroken data index'" in err.splitlines()[0]


def test_exit_codes_by_kind_of_error(capsys) -> None:
    from unbroken.ckpt.store import CorruptCheckpoint

    damaged = CorruptCheckpoint(4, "checksum", "x.distcp")
    try:
        raise RuntimeError("export failed") from damaged
    except RuntimeError as e:
        wrapped = e
    assert exit_code(CheckFailed("no checkpoint")) == 1
    assert exit_code(damaged) == 1 and exit_code(wrapped) == 1
    assert exit_code(ValueError("bad value")) == 2
    assert exit_code(FileNotFoundError("x: does not exist")) == 2
    assert exit_code(OSError(errno.ENOSPC, "full")) == 1
    assert main(["demo", "--steps", "-5"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        err == [err[0]] and err[0].startswith("unbroken: error: steps=-5") and "--steps" in err[0]
    )


# --- one source of defaults -----------------------------------------------------------------


def _actions(path: str) -> dict[str, argparse.Action]:
    p = _subs(build_parser())[path]
    return {a.option_strings[-1]: a for a in p._actions if a.option_strings}


@pytest.mark.parametrize("cmd,flags", [("run", RUN_FLAGS), ("preflight", PREFLIGHT_FLAGS)])
def test_every_flag_mirroring_a_config_field_has_its_default(cmd, flags) -> None:
    acts = _actions(cmd)
    for f in flags:
        assert acts[f.flags[-1]].default == config_default(f.config, f.field), f.flags
    # a flag added by hand (with its own default) must join the table instead
    by_hand = set(acts) - {f.flags[-1] for f in flags} - {"--help"}
    assert by_hand == ({"--preload", "--fault-rule", "--torchrun-arg"} if cmd == "run" else set())


def test_configs_built_from_no_flags_are_the_dataclass_defaults() -> None:
    parser = build_parser()
    assert run_config(parser.parse_args(["run", "--", "t.py"])) == RunConfig(command=("t.py",))
    assert preflight_config(parser.parse_args(["preflight"])) == PreflightConfig()


@pytest.mark.parametrize("cmd,flags", [("run", RUN_FLAGS), ("preflight", PREFLIGHT_FLAGS)])
def test_each_flag_sets_its_own_field(cmd, flags) -> None:
    """Every flag's value lands in its field of its dataclass (by keyword, not position)."""
    build = run_config if cmd == "run" else preflight_config
    part = {
        "RendezvousConfig": "rdzv",
        "WatchdogConfig": "watchdog",
        "RestartPolicy": "policy",
        "PreflightConfig": "preflight",
    }
    given = {
        "--nnodes": "1:2",
        "--rdzv-endpoint": "h:29500",
        "--run-id": "j",
        "--node": "n",
        "--run-dir": "r",
        "--ckpt-dir": "c",
        "--data": "d",
        "--gpu-min-free": 0.5,
        "--standby-start": "launch",  # a choice: twice the default is no value
    }
    acts = _actions(cmd)
    want: Any
    for f in flags:
        flag, d = f.flags[-1], f.default
        if f.action is not None:
            argv, want = [flag], not d
        else:
            convert = cast(Callable[[Any], Any], acts[flag].type)
            want = given[flag] if flag in given else convert(2 * (d or 1))
            argv = [flag, str(want)]
        if flag == "--nnodes":
            argv += ["--rdzv-endpoint", "h:29500"]
        tail = ["--", "t.py"] if cmd == "run" else []
        cfg = build(build_parser().parse_args([cmd, *argv, *tail]))
        nested = cmd == "run" and f.config is not RunConfig
        owner = getattr(cfg, part[f.config.__name__]) if nested else cfg
        assert getattr(owner, f.field) == want, (flag, getattr(owner, f.field), want)


def test_data_flag_defaults_are_the_library_defaults() -> None:
    from unbroken.data.prepare.pack import pack
    from unbroken.data.prepare.stage import stage
    from unbroken.data.tokens.tokenizer import tokenize

    data = _subs(_subs(build_parser())["data"])
    for cmd, fn in (("pack", pack), ("tokenize", tokenize), ("stage", stage)):
        params = inspect.signature(fn).parameters
        for a in data[cmd]._actions:
            if a.dest in params and a.option_strings:
                assert a.default == params[a.dest].default, (cmd, a.dest)
