"""What every command group of the CLI shares: how a command is declared (purpose, example),
argument types, and flags generated from the library's config dataclasses.

A flag that mirrors a config field (``--hang-timeout`` -> ``WatchdogConfig.hang_timeout``)
is declared once as a :class:`ConfigFlag`: its default is read from the dataclass, and the
dataclass is built from the parsed flags by keyword (:func:`config_kwargs`), so a default
lives in one place - the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from unbroken.common.config import parse_size

__all__ = [
    "ConfigFlag",
    "Formatter",
    "add_command",
    "add_config_flags",
    "at_least",
    "byte_count",
    "config_default",
    "config_kwargs",
    "host_port",
    "size",
]

Sub = argparse._SubParsersAction


class Formatter(argparse.HelpFormatter):
    """Wraps each paragraph of a description or epilog on its own; a line that starts with
    white space (an example command) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if para.startswith(" ") or "\n " in para:
                out.append("\n".join(indent + ln for ln in para.splitlines()))
            else:
                out.append(
                    textwrap.fill(
                        " ".join(para.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        return "\n\n".join(out)


def add_command(
    sub: Sub,
    name: str,
    purpose: str,
    example: str,
    details: str = "",
    *,
    func: Callable[[argparse.Namespace], int] | None = None,
) -> argparse.ArgumentParser:
    """Register ``name``: ``purpose`` (one line, also its line in the parent's list), an
    optional paragraph of ``details``, and one ``example`` command line as the epilog."""
    p = sub.add_parser(
        name,
        help=purpose,
        description=purpose + (f"\n\n{details}" if details else ""),
        epilog=f"example:\n  {example}",
        formatter_class=Formatter,
    )
    if func is not None:
        p.set_defaults(func=func)
    return p


def size(text: str) -> int:
    """An argparse type: ``"256MB"`` -> 256_000_000, ``"1GiB"`` -> 1_073_741_824 (> 0)."""
    n = byte_count(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive, like 256MB")
    return n


def byte_count(text: str) -> int:
    """An argparse type: a size like :func:`size`, or 0 (a threshold that is off)."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 256MB or 1GiB") from None


def host_port(text: str) -> str:
    """An argparse type: ``HOST:PORT`` with a numeric port (0: a free one)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT, like 127.0.0.1:29500")
    return text


def at_least(lo: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` that is >= ``lo``."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not v >= lo:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {lo}")
        return v

    return parse


# --- flags generated from config dataclasses ------------------------------------------------


def config_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (a ``default_factory`` is called)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise LookupError(f"{cls.__name__}.{name} has no default")
    raise LookupError(f"{cls.__name__} has no field {name!r}")


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
    """One command-line flag standing for one field of a config dataclass."""

    flags: tuple[str, ...]
    """Option strings, e.g. ``("--hang-timeout",)`` or ``("-q", "--quiet")``."""
    config: type
    """The frozen config dataclass that owns the default."""
    field: str
    """The field of ``config`` the flag sets."""
    help: str
    """What the flag means; `` (default: X)`` is appended from the dataclass."""
    type: Callable[[str], Any] | None = None
    """Parses the value; default: the type of the field's default (str when it is None)."""
    action: str | None = None
    """``store_true`` / ``store_false`` for a boolean field (the flag takes no value)."""
    unit: str = ""
    """Shown after the default in the help: ``" s"``, ``" bytes"``."""
    shown: str | None = None
    """What the help says the default is, when the value itself does not say it."""

    @property
    def dest(self) -> str:
        return self.flags[-1].lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return config_default(self.config, self.field)


def add_config_flags(p: argparse.ArgumentParser, flags: Sequence[ConfigFlag]) -> None:
    for f in flags:
        d = f.default
        if f.action is not None:
            p.add_argument(*f.flags, dest=f.dest, action=f.action, default=d, help=f.help)
            continue
        kind = f.type or (str if d is None else type(d))
        if f.shown is not None or d is None:
            shown = f.shown or "none"
        elif f.unit == " bytes":
            shown = f"{d:,} bytes = {d / 2**20:g} MiB"
        else:
            shown = f"{d}{f.unit}"
        p.add_argument(
            *f.flags, dest=f.dest, type=kind, default=d, help=f"{f.help} (default: {shown})"
        )


def config_kwargs(
    cls: type, flags: Sequence[ConfigFlag], args: argparse.Namespace
) -> dict[str, Any]:
    """The keyword arguments of ``cls`` that ``flags`` set, read from the parsed ``args``."""
    return {f.field: getattr(args, f.dest) for f in flags if f.config is cls}
