"""How a component takes its config: one frozen dataclass, or the same options as keywords.

Each component has one frozen dataclass that holds its defaults and validates them in
``__post_init__`` (``CheckpointConfig``, ``ArchiveConfig``, ``LoaderConfig``). Its
constructor also takes the options as keywords whose defaults are read from the dataclass
(``keep_last: int | None = CheckpointConfig.keep_last``), so a default is written once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "check_choice",
    "configure",
    "check_count",
    "check_flag",
    "check_seconds",
    "parse_size",
]

C = TypeVar("C", bound="DataclassInstance")


def configure(cls: type[C], config: C | None, overrides: Mapping[str, Any], *, owner: str) -> C:
    """The config ``owner`` runs with: ``config`` (default ``cls()``) with ``overrides``, field
    names of ``cls``, applied by ``dataclasses.replace`` (so ``__post_init__`` validates the
    result). The one way into a component: ``Component(..., config=None, **overrides)``; a
    keyword that is not a field is a ``TypeError`` that lists the fields."""
    if config is None:
        config = cls()
    elif not isinstance(config, cls):
        raise TypeError(
            f"{owner}(config=...) takes a {cls.__name__}, got {type(config).__qualname__}; "
            f"pass options as keywords named like its fields ({owner}(..., name=value))"
        )
    if not overrides:
        return config
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(
            f"{owner}() got unexpected keyword argument(s) {', '.join(unknown)}; its options are "
            f"the fields of {cls.__name__}: {', '.join(names)}"
        )
    return dataclasses.replace(config, **overrides)


# --- checks for __post_init__: each names the option, the value and the fix --------------


def check_count(owner: str, name: str, v: Any, *, least: int = 1, none: str | None = None) -> None:
    """``v`` must be an int >= ``least``; or None, when ``none`` says what None means."""
    if v is None and none is not None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        also = f", or None ({none})" if none is not None else ""
        raise ValueError(
            f"{owner}.{name}={v!r} must be an integer >= {least}{also}; pass e.g. "
            f"{name}={max(least, 1)}"
        )


def check_seconds(
    owner: str, name: str, v: Any, *, positive: bool = False, none: str | None = None
) -> None:
    """``v`` must be a finite number of seconds, >= 0 (> 0 when ``positive``); or None,
    when ``none`` says what None means."""
    if v is None and none is not None:
        return
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if not ok or v < 0 or (positive and v == 0):
        also = f", or None ({none})" if none is not None else ""
        raise ValueError(
            f"{owner}.{name}={v!r} must be a finite number of seconds "
            f"{'> 0' if positive else '>= 0'}{also}"
        )


def check_flag(owner: str, name: str, v: Any, *, none: str | None = None) -> None:
    """``v`` must be True or False; or None, when ``none`` says what None means."""
    if isinstance(v, bool) or (v is None and none is not None):
        return
    also = f", or None ({none})" if none is not None else ""
    raise ValueError(f"{owner}.{name}={v!r} must be True or False{also}")


def check_choice(owner: str, name: str, v: Any, choices: Sequence[str]) -> None:
    if v not in choices:
        raise ValueError(f"{owner}.{name}={v!r} is not one of {tuple(choices)}")


def parse_size(text: str | int) -> int:
    """``"200GB"`` -> 200_000_000_000, ``"1GiB"`` -> 1_073_741_824, ``4096`` -> 4096."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size {text} must be >= 0")
        return text
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    t = str(text).strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        value = int(float(num) * units[t[len(num) :]])
    except (KeyError, ValueError, OverflowError):  # OverflowError: "1e400" is inf
        raise ValueError(f"{text!r} is not a size like 256MB or 1GiB") from None
    if value < 0:
        raise ValueError(f"size {text!r} must be >= 0")
    return value
