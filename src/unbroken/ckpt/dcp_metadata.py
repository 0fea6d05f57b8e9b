"""DCP's ``.metadata`` file, checked without running anything it names.

``torch.distributed.checkpoint`` stores its metadata as a pickle, and a pickle can name any
importable callable (``os.system``) and call it. unbroken never needs that file to load a
checkpoint (tensor locations come from our JSON manifest), but it belongs to the checkpoint:
``dcp.load`` and DCP's tools unpickle it. So restore and ``ckpt verify`` check it, and a
checkpoint whose ``.metadata`` names anything outside DCP's own data classes is refused as
crafted (and the next older checkpoint is used).

How it is checked: pickle's own parser runs with a ``find_class`` that resolves each global
against an EXACT allow-list of ``(module, qualname)`` pairs (no prefixes, no dotted names)
to an inert stand-in defined here. Nothing the file names is imported, constructed or
called: ``REDUCE``/``NEWOBJ``/``BUILD`` only ever reach these stand-ins, whose methods
copy nothing (what a parse allocates stays what the opcode walk charged). The result must
be the stand-in of DCP's ``Metadata``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from unbroken.ckpt.bounds import Budget, pickle_cost
from unbroken.ckpt.manifest import DTYPES

__all__ = ["UnsafeMetadata", "check_dcp_metadata"]

_MD = "torch.distributed.checkpoint.metadata"
# Classes DCP's metadata is built from (created with NEWOBJ, filled with BUILD).
_CLASSES = frozenset(
    {
        (_MD, "Metadata"),
        (_MD, "TensorStorageMetadata"),
        (_MD, "BytesStorageMetadata"),
        (_MD, "ChunkStorageMetadata"),
        (_MD, "TensorProperties"),
        (_MD, "MetadataIndex"),
        (_MD, "StorageMeta"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }
)
# Callables DCP's metadata applies with REDUCE (values, never effects).
_CALLABLES = frozenset(
    {
        ("torch.serialization", "_get_layout"),
        (_MD, "_MEM_FORMAT_ENCODING"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)
# Plain values referenced by name.
_VALUES = frozenset(
    {("torch", d) for d in DTYPES}
    | {("torch", n) for n in ("strided", "contiguous_format", "channels_last", "preserve_format")}
)


class UnsafeMetadata(ValueError):
    """``.metadata`` is not a DCP metadata pickle made only of DCP's data classes."""


class _Stub:
    """An instance of an allow-listed class. Pickle makes it with ``object.__new__`` and
    hands ``BUILD``'s state to :meth:`__setstate__`, which keeps a reference: a dict update
    would copy the state into every instance, so one memoized dict built into many stubs
    would cost memory the file never paid for (T-BOUNDED)."""

    __slots__ = ("state",)
    _name = ""

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Call:
    """An allow-listed callable: calling it yields its name. Nothing of the arguments is
    kept (a call's ``*args`` is a copy: one memoized tuple passed to many calls would
    cost memory the file never paid for)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any) -> str:
        return self.name


_STUB_TYPES: dict[tuple[str, str], type[_Stub]] = {
    key: type(key[1], (_Stub,), {"_name": f"{key[0]}.{key[1]}", "__slots__": ()})
    for key in _CLASSES
}
# torch.Size(list): a call like the others (the builtin ``tuple`` would copy its argument,
# e.g. 1 MiB of memoized bytes into an 8 MiB tuple, once per application).
_CALLS = {key: _Call(f"{key[0]}.{key[1]}") for key in _CALLABLES | {("torch", "Size")}}


class _Checker(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _STUB_TYPES:
            return _STUB_TYPES[key]
        if key in _CALLS:
            return _CALLS[key]
        if key in _VALUES:
            return f"{module}.{name}"
        raise UnsafeMetadata(f"names {module}.{name}, which DCP metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadata("uses a persistent id, which DCP metadata never holds")


def check_dcp_metadata(data: bytes, where: str, budget: Budget | None = None) -> None:
    """Raise :class:`UnsafeMetadata` unless ``data`` is a DCP metadata pickle built only of
    DCP's data classes. Runs no code from ``data``. Its opcodes are walked first and what
    unpickling them may cost is charged to ``budget`` (default: what ``data`` alone
    justifies); a bomb raises :class:`~unbroken.ckpt.bounds.TooCostly` unparsed."""
    (budget or Budget(len(data))).charge(pickle_cost(data, where), where)
    try:
        top = _Checker(io.BytesIO(data)).load()
    except UnsafeMetadata as e:
        raise UnsafeMetadata(f"{where} {e}; refusing a crafted checkpoint") from None
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle: pickle raises many types
        raise UnsafeMetadata(
            f"{where} is not a readable pickle ({type(e).__name__}: {e})"
        ) from None
    if type(top) is not _STUB_TYPES[(_MD, "Metadata")]:
        raise UnsafeMetadata(f"{where} does not hold a DCP Metadata object")
