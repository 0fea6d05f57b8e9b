"""Lazy re-exports: a package names its public API without importing torch at start-up."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` resolving ``name`` from ``table[name]`` on first use."""

    def __getattr__(name: str) -> object:
        mod = table.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(mod), name)

    return __getattr__
