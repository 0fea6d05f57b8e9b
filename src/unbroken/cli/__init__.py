"""The ``unbroken`` command: parses arguments, calls the library, prints.

One module per command group registers its commands (``data``, ``ckpt``, ``elastic`` for
run/preflight/report/plan/drill, ``demo``); handlers import the library lazily so
``unbroken --help`` stays fast. The command tree is in ARCHITECTURE.md ("Design notes" >
cli).

Exit codes (every command):
  0  success
  1  a check failed: a damaged checkpoint, a failed pre-flight check, a drill or demo whose
     resumed run diverged, no checkpoint where one was expected; also an unexpected error
     or an I/O failure such as a full disk
  2  bad input or usage: an unknown command or option, a bad option value, a missing or
     unreadable path, a file that is not what the command reads
  130 interrupted (Ctrl-C)
  unbroken run adds 3 same failure twice, 4 restart budget used up, 5 no progress,
  6 pre-flight never healthy, 7 preempted (rerun the same command to resume), 8 the
  checkpoint refused the job's configuration at restore (RestoreRefused: world size,
  shapes; not retried).
An error is one line on stderr (``unbroken: error: ...``), never a traceback (``--verbose``
adds the traceback of an unexpected one).
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import sys
import traceback
from collections.abc import Sequence

from unbroken import __version__
from unbroken.cli._args import Formatter
from unbroken.cli.ckpt import add_ckpt
from unbroken.cli.data import PREP_COMMANDS, add_data
from unbroken.cli.demo import add_demo
from unbroken.cli.elastic import add_elastic
from unbroken.common.errors import is_check_failure

__all__ = ["DEPRECATED", "build_parser", "exit_code", "main"]

DEPRECATED: dict[str, tuple[str, ...]] = {c: ("data", c) for c in sorted(PREP_COMMANDS)}
"""Old top-level spellings (removed in the next release) and what they now are."""

_ABOUT = (
    "unbroken keeps PyTorch training jobs fed and alive.\n\nIt packs and streams sharded "
    "datasets that resume at the exact sample, writes checkpoints that survive a kill at any "
    "moment and are verified before they are restored, and supervises torchrun so that a "
    "crash, hang or lost node costs a restart, not the job."
)
# the table above, once: `unbroken --help` shows it (python -OO drops docstrings, and it)
_EXIT_CODES = (__doc__ or "").partition("Exit codes (every command):\n")[2].partition("An error")[0]
_EPILOG = "example:\n  unbroken run --nproc-per-node 8 --ckpt-dir /ckpt -- train.py" + (
    f"\n\nexit codes:\n{_EXIT_CODES}" if _EXIT_CODES else ""
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unbroken", description=_ABOUT, epilog=_EPILOG, formatter_class=Formatter
    )
    parser.add_argument("--version", action="version", version=f"unbroken {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    add_data(sub)
    add_ckpt(sub)
    add_elastic(sub)
    add_demo(sub)
    return parser


def _undeprecate(argv: list[str]) -> list[str]:
    """``unbroken [-v] pack ...`` -> ``unbroken [-v] data pack ...``, with one line on stderr."""
    for i, tok in enumerate(argv):
        if tok in ("-v", "--verbose"):
            continue
        if tok in DEPRECATED:
            new = " ".join(DEPRECATED[tok])
            print(
                f"unbroken: 'unbroken {tok}' is deprecated; use 'unbroken {new}'", file=sys.stderr
            )
            return [*argv[:i], *DEPRECATED[tok], *argv[i + 1 :]]
        break
    return argv


# A path the user named that cannot be used is bad input (2); any other OSError (a full
# disk, an I/O error) is a failure of the command (1).
_BAD_PATH_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.EACCES,
        errno.EPERM,
        errno.ELOOP,
        errno.ENAMETOOLONG,
        errno.EINVAL,
        errno.EROFS,
    }
)


def exit_code(e: BaseException) -> int:
    """The exit code of ``main`` for an error a command raised (see the module docstring)."""
    if is_check_failure(e):
        return 1
    if isinstance(e, (ValueError, RuntimeError)):
        return 2
    if isinstance(e, OSError):
        return 2 if e.errno in _BAD_PATH_ERRNOS or e.errno is None else 1
    return 1


def _one_line(e: BaseException) -> str:
    """The exception's message on one line (a multi-line message is joined with ' | ')."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = " | ".join(lines) or type(e).__name__
    return text if len(text) <= 4000 else text[:4000] + " ..."


def _nonsense(args: argparse.Namespace) -> str | None:
    """A value no command takes, whatever its option: a float that is not finite (argparse's
    ``float`` accepts "nan" and "1e400"), a string with a NUL byte (no path holds one)."""
    for name, v in vars(args).items():
        if isinstance(v, float) and not math.isfinite(v):
            return f"--{name.replace('_', '-')}={v}: not a finite number"
        vals = v if isinstance(v, list) else [v]
        if any(isinstance(x, str) and "\x00" in x for x in vals):
            return f"{name}: a value holds a NUL byte"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = _undeprecate(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    bad = _nonsense(args)
    if bad is not None:
        print(f"unbroken: error: {bad}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # unbroken's own INFO lines (what a command is doing); other libraries' (botocore's
    # credential lookup on every S3 call) only with --verbose
    logging.getLogger("unbroken").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if getattr(args, "data_cmd", None) in PREP_COMMANDS and not args.verbose:
        # These commands print their summary on stdout; the library's INFO line says the same.
        logging.getLogger("unbroken.data").setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("unbroken: interrupted", file=sys.stderr)
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP raises BaseException subclasses
        known = isinstance(e, (ValueError, RuntimeError, OSError)) or is_check_failure(e)
        if known:
            print(f"unbroken: error: {_one_line(e)}", file=sys.stderr)
            return exit_code(e)
        # Not an error the library names: say what it was in one line; the traceback is for
        # --verbose (and for a bug report).
        if args.verbose:
            traceback.print_exc()
        print(
            f"unbroken: error: {type(e).__name__}: {_one_line(e)} (unexpected; run with "
            "--verbose for the traceback and report it)",
            file=sys.stderr,
        )
        return 1
