"""What reading a checkpoint may cost in memory, checked before any parser runs (T-BOUNDED).

A checkpoint is untrusted input, and a few bytes can ask a parser for gigabytes: a 62-byte
pickle whose ``LONG_BINPUT`` names memo slot 2^30 makes CPython's C unpickler allocate a
16 GiB memo array; a JSON or pickle of empty containers costs 25-70 bytes of objects per
input byte. The rule, per step directory holding ``B`` bytes of files:

    every parse of one checkpoint together may cost at most ``2 * B + 256 MiB``

(:class:`Budget`). A real checkpoint is far inside it: its JSON and pickles describe
tensor data many times their size. Each parse is charged an upper bound on what it can
allocate, computed from the raw bytes at C speed (:func:`json_cost`) or by walking the
pickle's opcodes without building anything (:func:`pickle_cost`, which also refuses memo
indices beyond the slots written so far and lengths beyond the data). A file over budget
is damage (:class:`TooCostly`), quarantined like any other, never an out-of-memory kill.
``manifest.json`` is also capped at :data:`MAX_MANIFEST` bytes.
"""

from __future__ import annotations

import contextlib
import json
import pickletools
from collections.abc import Iterator
from typing import Any

__all__ = [
    "HEADROOM",
    "MAX_MANIFEST",
    "Budget",
    "TooCostly",
    "json_cost",
    "load_json",
    "pickle_cost",
]

HEADROOM = 256 << 20
"""Bytes any checkpoint may spend on parsing beyond twice its files."""
MAX_MANIFEST = 256 << 20
"""``manifest.json`` above this size is damage whatever the rest (a manifest lists ~250
bytes per stored chunk: a million chunks fit)."""

# Upper bounds, in bytes, measured on CPython 3.12 (x86-64). JSON: an empty list or dict in
# a list costs 64-90 bytes per bracket; a short string, float or int at most ~17 bytes per
# input byte, the decoded text up to 4 more (one astral character makes a str 4 bytes
# per character).
_JSON_PER_BRACKET = 96
_JSON_PER_BYTE = 21
# Pickle: an opcode that makes a new object (a dict, a tuple, an instance) costs at most
# ~100 bytes; one that only moves references (MARK, MEMOIZE, BINGET, APPENDS) a stack or
# memo slot (the C memo doubles as it grows: 16 bytes per slot); text and bytes their
# length, four times over for text.
_PICKLE_PER_OBJECT = 112
_PICKLE_PER_REF = 16


class TooCostly(ValueError):
    """A file that would cost more memory to parse than its checkpoint can justify."""


class Budget:
    """The parse budget of one checkpoint: ``2 * file_bytes + HEADROOM``, spent by
    :meth:`charge` (cumulative: everything parsed may be alive at once)."""

    def __init__(self, file_bytes: int) -> None:
        self.limit = 2 * max(0, file_bytes) + HEADROOM
        self.spent = 0

    def charge(self, cost: int, where: str) -> None:
        if self.spent + cost > self.limit:
            raise TooCostly(
                f"{where} would cost up to {cost / 2**20:.0f} MiB to parse; this checkpoint's "
                f"files justify {(self.limit - self.spent) / 2**20:.0f} MiB more (2 x their "
                f"bytes + {HEADROOM >> 20} MiB); refusing a memory bomb"
            )
        self.spent += cost

    @contextlib.contextmanager
    def scope(self) -> Iterator[Budget]:
        """What is charged inside is given back on exit (parsed, checked and dropped)."""
        spent = self.spent
        try:
            yield self
        finally:
            self.spent = spent


def json_cost(raw: bytes) -> int:
    """An upper bound on the memory ``json.loads(raw)`` allocates (objects and text)."""
    return _JSON_PER_BRACKET * (raw.count(b"[") + raw.count(b"{")) + _JSON_PER_BYTE * len(raw)


def load_json(raw: bytes, budget: Budget, where: str) -> Any:
    """``json.loads(raw)`` once :func:`json_cost` fits ``budget``."""
    budget.charge(json_cost(raw), where)
    return json.loads(raw)


# Per opcode byte: its argument layout (None: refused), what it may allocate, and its kind.
# Layout: n >= 0 fixed bytes; -1 one line; -2 two lines; -11 / -14 / -18 a 1 / 4 / 8-byte
# unsigned length, then that many bytes; -15 a signed 4-byte length.
_NO = -99  # a refused or unknown opcode
_LAYOUT = [_NO] * 256
_COST = [0] * 256
_KIND = [0] * 256
_PLAIN, _MEMOIZE, _BINPUT, _LONG_BINPUT, _PUT, _FRAME, _STOP = range(7)
_KINDS = {
    "MEMOIZE": _MEMOIZE, "BINPUT": _BINPUT, "LONG_BINPUT": _LONG_BINPUT, "PUT": _PUT,
    "FRAME": _FRAME, "STOP": _STOP,
}  # fmt: skip
# Never in DCP's or torch.save's pickles: out-of-band buffers and the copyreg extension
# registry reach state outside the bytes, INST/OBJ are protocol-0 object construction.
_REFUSED = frozenset({"EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER", "INST", "OBJ"})
_REFS = frozenset(
    {
        "MARK", "POP", "POP_MARK", "DUP", "BINGET", "LONG_BINGET", "GET", "MEMOIZE", "PUT",
        "BINPUT", "LONG_BINPUT", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS",
        "PROTO", "FRAME", "STOP", "NONE", "NEWTRUE", "NEWFALSE", "BUILD",
    }
)  # fmt: skip
_TEXT = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
     "BINUNICODE8"}
)  # fmt: skip
_NAMES: dict[int, str] = {}


def _fill_tables() -> None:
    special = {
        pickletools.UP_TO_NEWLINE: -1,
        pickletools.TAKEN_FROM_ARGUMENT1: -11,
        pickletools.TAKEN_FROM_ARGUMENT4: -15,
        pickletools.TAKEN_FROM_ARGUMENT4U: -14,
        pickletools.TAKEN_FROM_ARGUMENT8U: -18,
    }
    for op in pickletools.opcodes:
        code = ord(op.code)
        _NAMES[code] = op.name
        if op.name in _REFUSED:
            continue
        n = 0 if op.arg is None else op.arg.n
        _LAYOUT[code] = -2 if op.name == "GLOBAL" else special.get(n, n)  # "module\nname\n"
        _COST[code] = _PICKLE_PER_REF if op.name in _REFS else _PICKLE_PER_OBJECT
        _KIND[code] = _KINDS.get(op.name, _PLAIN)
        if op.name in _TEXT:
            _KIND[code] = -1  # payload costs 4x (a str may take 4 bytes per character)


_fill_tables()
_MEMOIZE_OP, _STOP_OP = 0x94, ord(".")
_WIDTH = {-11: 1, -14: 4, -15: 4, -18: 8}


def pickle_cost(data: bytes, where: str) -> int:
    """Walk ``data``'s opcodes as pickle reads them, up to STOP, building nothing; return an
    upper bound on what unpickling it allocates. Raises :class:`TooCostly` for what no
    unpickler should be handed: an unknown or refused opcode, a length beyond the data, a
    memo slot beyond those written so far (the C unpickler sizes its memo array by the
    largest index it is given), or no STOP."""
    n = len(data)
    i = memo = cost = 0
    layouts, costs, kinds = _LAYOUT, _COST, _KIND
    while i < n:  # hot loop (millions of opcodes in a large DCP metadata): kept flat
        op = data[i]
        layout = layouts[op]
        i += 1
        cost += costs[op]
        if layout == 0:
            if op == _MEMOIZE_OP:
                memo += 1
            elif op == _STOP_OP:
                return cost
        elif layout > 0:
            if i + layout > n:
                break
            kind = kinds[op]
            if kind == _BINPUT or kind == _LONG_BINPUT:
                memo = _put(data[i] if kind == _BINPUT else _u32(data, i), memo, where, i)
            elif kind == _FRAME and _u64(data, i) > n - i - 8:
                break
            i += layout
        elif layout < -10:
            width = _WIDTH[layout]
            size = int.from_bytes(data[i : i + width], "little", signed=layout == -15)
            i += width
            if i > n or size < 0 or size > n - i:
                break
            i += size
            cost += size * (4 if kinds[op] == -1 else 1)
        elif layout < 0 and layout != _NO:
            start = i
            for _ in range(-layout):
                j = data.find(b"\n", i)
                if j < 0:
                    raise TooCostly(f"{where}: {_NAMES[op]} at byte {start - 1} runs past the end")
                i = j + 1
            cost += 4 * (i - start)
            if kinds[op] == _PUT:
                try:
                    index = int(data[start : i - 1])
                except ValueError:
                    raise TooCostly(f"{where}: PUT at byte {start - 1} has no index") from None
                memo = _put(index, memo, where, start)
        else:
            raise TooCostly(f"{where}: opcode {op:#04x} at byte {i - 1} is not allowed here")
    else:
        raise TooCostly(f"{where}: no STOP opcode (truncated)")
    raise TooCostly(f"{where}: {_NAMES[op]} at byte {i - 1} runs past the end")


def _u32(data: bytes, i: int) -> int:
    return int.from_bytes(data[i : i + 4], "little")


def _u64(data: bytes, i: int) -> int:
    return int.from_bytes(data[i : i + 8], "little")


def _put(index: int, memo: int, where: str, at: int) -> int:
    """The memo slots written after a PUT to ``index``: the next slot, or an existing one."""
    if not 0 <= index <= memo:
        raise TooCostly(
            f"{where}: a PUT at byte {at - 1} names memo slot {index}, {memo} written so far "
            "(a memo-size bomb)"
        )
    return memo + (index == memo)
