"""Pickle-free encoding of state dicts: JSON for structure, tensors kept aside.

``encode`` turns a nested state dict into a JSON tree plus a flat ``{key: tensor}`` dict
(the tensors go to the DCP files); ``decode`` rebuilds the original objects from an
allow-list of types, so loading a checkpoint can never execute code from it.

Types: None, bool, int, float (NaN/inf kept), str, list, tuple, dict (any scalar keys),
``Counter``, ``defaultdict`` (of a plain type), set and frozenset (of plain values),
bytes, torch.Tensor, torch.dtype, torch.Size, torch.device, numpy arrays and scalars.
Tagged values are JSON objects with the reserved key ``"__ub__"``.
"""

from __future__ import annotations

import base64
import logging
import operator
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["decode", "encode", "first_difference", "is_ref", "rekey", "tensor_keys"]

log = logging.getLogger(__name__)

_TAG = "__ub__"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _tensor_inline(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {
        _TAG: "tinline",
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "b64": _b64(raw),
    }


_PLAIN = frozenset({type(None), bool, int, float, str})
_STR = frozenset({str})
_tagged = operator.methodcaller("startswith", _TAG)


def _plain(items: list[Any] | tuple[Any, ...]) -> bool:
    """Every item is a plain scalar, encoded as itself: the sequence needs no walk (the
    python RNG's 625 ints, an optimizer's parameter ids; issue 25 item 3)."""
    return set(map(type, items)) <= _PLAIN  # C loops: the RNG's 625 ints in microseconds


_KEYS: dict[tuple[str, ...], str] = {}  # path -> tensor key: a save repeats the same paths


def _key(path: tuple[str, ...]) -> str:
    if len(_KEYS) > 1 << 16:  # bounded: states with many distinct paths still encode
        _KEYS.clear()
    key = _KEYS[path] = "/".join(p.replace("/", "%2F") for p in path)
    return key


def _tensor_refs(
    obj: Mapping[str, torch.Tensor], tensors: dict[str, torch.Tensor], path: tuple[str, ...]
) -> dict[str, Any]:
    """:func:`encode` of a str-keyed mapping of plain tensors, without a call per tensor."""
    out: dict[str, Any] = {}
    for k, t in obj.items():
        sub = (*path, k)
        key = _KEYS.get(sub) or _key(sub)
        if key in tensors:
            raise ValueError(f"two tensors map to checkpoint key {key!r}; rename one state key")
        tensors[key] = t
        out[k] = {_TAG: "tensor", "key": key}
    return out


def _npscalar(obj: np.generic) -> dict[str, Any]:
    return {_TAG: "npscalar", "dtype": obj.dtype.str, "value": obj.item()}


def _ndarray(obj: np.ndarray, path: tuple[str, ...]) -> dict[str, Any]:
    if obj.dtype.kind in "OV":  # pointers, or fields the dtype string does not name
        raise TypeError(
            f"cannot checkpoint state at {'/'.join(path) or '<root>'!r}: a numpy array of "
            f"dtype {obj.dtype} (objects or record fields) has no plain bytes to save; return "
            "plain arrays, lists or tensors from state_dict()"
        )
    arr = np.ascontiguousarray(obj)
    return {
        _TAG: "ndarray",
        "dtype": arr.dtype.str,
        "shape": list(arr.shape),
        "b64": _b64(arr.tobytes()),
    }


def _encode_mapping(
    obj: Mapping[Any, Any], tensors: dict[str, torch.Tensor] | None, path: tuple[str, ...]
) -> Any:
    keys_str = set(map(type, obj)) <= _STR or all(isinstance(k, str) for k in obj)
    if keys_str and not any(map(_tagged, obj)):
        if tensors is not None and all(type(v) is torch.Tensor for v in obj.values()):
            return _tensor_refs(obj, tensors, path)  # a module's state dict: one loop
        return {k: encode(v, tensors, (*path, k)) for k, v in obj.items()}
    return {
        _TAG: "dict",
        "items": [
            [encode(k, None, path), encode(v, tensors, (*path, str(k)))] for k, v in obj.items()
        ],
    }


# What a defaultdict may fill missing keys with: types whose call makes an empty value.
_FACTORIES: dict[str, Any] = {f.__name__: f for f in (int, float, str, bool, list, dict, tuple, set, Counter)}  # fmt: skip
_told: set[str] = set()


def _encode_counting(
    obj: Counter[Any] | defaultdict[Any, Any],
    tensors: dict[str, torch.Tensor] | None,
    path: tuple[str, ...],
) -> Any:
    """A ``Counter``, or a ``defaultdict`` filling with a type of :data:`_FACTORIES`, tagged
    so that decoding gives its type back: restored as a plain dict, the first count of a new
    key raised ``KeyError`` after the resume. A defaultdict of another factory (a lambda)
    is saved as a dict, said once per path."""
    items = _encode_mapping(dict(obj), tensors, path)
    if isinstance(obj, Counter):
        return {_TAG: "counter", "map": items}
    name = getattr(obj.default_factory, "__name__", None)
    if obj.default_factory is None or _FACTORIES.get(name or "") is not obj.default_factory:
        where = "/".join(path) or "<root>"
        if where not in _told:
            _told.add(where)
            log.warning(
                "state at %r is a defaultdict of %r: saved as a plain dict (only the "
                "factories %s are kept); its load_state_dict gets a dict",
                where, obj.default_factory, sorted(_FACTORIES),
            )  # fmt: skip
        return items
    return {_TAG: "defaultdict", "factory": name, "map": items}


def _encode_set(obj: set[Any] | frozenset[Any], path: tuple[str, ...]) -> Any:
    """A set of plain values, in an order that does not depend on the process's string
    hashing (the same set encodes to the same bytes in every run)."""
    items = [encode(v, None, path) for v in obj]
    items.sort(key=lambda v: (type(v).__name__, repr(v)))
    return {_TAG: "frozenset" if isinstance(obj, frozenset) else "set", "items": items}


def encode(
    obj: Any,
    tensors: dict[str, torch.Tensor] | None,
    path: tuple[str, ...] = (),
) -> Any:
    """Encode ``obj``; tensors go into ``tensors`` under a path key, or inline when None."""
    if isinstance(obj, np.floating):  # before float: np.float64 is one, and must stay np.float64
        return _npscalar(obj)
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, torch.Tensor):
        if tensors is None:
            return _tensor_inline(obj)
        key = _KEYS.get(path) or _key(path)
        if key in tensors:
            raise ValueError(f"two tensors map to checkpoint key {key!r}; rename one state key")
        tensors[key] = obj
        return {_TAG: "tensor", "key": key}
    if isinstance(obj, Mapping):
        if type(obj) is not dict and isinstance(obj, Counter | defaultdict):
            return _encode_counting(obj, tensors, path)
        return _encode_mapping(obj, tensors, path)
    if isinstance(obj, torch.Size):
        return {_TAG: "size", "items": list(obj)}
    if isinstance(obj, tuple):
        items = (
            list(obj)
            if _plain(obj)
            else [encode(v, tensors, (*path, str(i))) for i, v in enumerate(obj)]
        )
        return {_TAG: "tuple", "items": items}
    if isinstance(obj, list):
        return (
            list(obj)
            if _plain(obj)
            else [encode(v, tensors, (*path, str(i))) for i, v in enumerate(obj)]
        )
    return _encode_leaf(obj, path)


def _encode_leaf(obj: Any, path: tuple[str, ...]) -> Any:
    """:func:`encode` of the types that hold no tensor to store apart."""
    if isinstance(obj, set | frozenset):
        return _encode_set(obj, path)
    if isinstance(obj, bytes | bytearray):
        return {_TAG: "bytes", "b64": _b64(bytes(obj))}
    if isinstance(obj, torch.dtype):
        return {_TAG: "dtype", "name": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {_TAG: "device", "name": str(obj)}
    if isinstance(obj, np.ndarray):
        return _ndarray(obj, path)
    if isinstance(obj, np.generic):
        return _npscalar(obj)
    where = "/".join(path) or "<root>"
    raise TypeError(
        f"cannot checkpoint state at {where!r}: type {type(obj).__module__}.{type(obj).__qualname__} "
        "is not a tensor, number, string, list, tuple or dict; return plain values from "
        "state_dict() (checkpoints are pickle-free so loading never runs code)"
    )


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in checkpoint")
    return dt


def decode(obj: Any, tensors: Mapping[str, torch.Tensor] | None = None) -> Any:  # noqa: C901 - one branch per encoded kind
    """Inverse of :func:`encode`; ``tensors`` supplies the values of ``tensor`` references."""
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: decode(v, tensors) for k, v in obj.items()}
    if tag == "tensor":
        if tensors is None or obj["key"] not in tensors:
            raise ValueError(f"checkpoint references tensor {obj['key']!r} that was not loaded")
        return tensors[obj["key"]]
    if tag == "tinline":
        raw = bytearray(base64.b64decode(obj["b64"]))
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(_dtype(obj["dtype"])).reshape(obj["shape"]).clone()
    if tag == "dict":
        out = {decode(k, tensors): decode(v, tensors) for k, v in obj["items"]}
        if len(out) != len(obj["items"]):  # encode never writes a key twice (nor 1 and True)
            raise ValueError("a dict in checkpoint state repeats a key")
        return out
    if tag == "tuple":
        return tuple(decode(v, tensors) for v in obj["items"])
    if tag in ("counter", "defaultdict"):
        mapping = decode(obj["map"], tensors)
        if not isinstance(mapping, dict):
            raise ValueError(f"a {tag} in checkpoint state holds no mapping")
        if tag == "counter":
            return Counter(mapping)
        factory = _FACTORIES.get(obj.get("factory"))  # type: ignore[arg-type]
        if factory is None:
            raise ValueError(f"a defaultdict of {obj.get('factory')!r} in checkpoint state")
        return defaultdict(factory, mapping)
    if tag in ("set", "frozenset"):
        try:
            items = [decode(v, tensors) for v in obj["items"]]
            return frozenset(items) if tag == "frozenset" else set(items)
        except TypeError:  # an unhashable item: never written by encode
            raise ValueError(f"a {tag} in checkpoint state holds an unhashable item") from None
    if tag == "size":
        return torch.Size(obj["items"])
    if tag == "bytes":
        return base64.b64decode(obj["b64"])
    if tag == "dtype":
        return _dtype(obj["name"])
    if tag == "device":
        return torch.device(obj["name"])
    if tag == "ndarray":
        arr = np.frombuffer(base64.b64decode(obj["b64"]), dtype=np.dtype(obj["dtype"]))
        return arr.reshape(obj["shape"]).copy()
    if tag == "npscalar":
        dt = np.dtype(obj["dtype"])
        if dt.kind in "OV":  # never written (JSON holds no such value); np.void(n) is n bytes
            raise ValueError(f"a numpy scalar of dtype {dt.str!r} in checkpoint state")
        return dt.type(obj["value"])
    raise ValueError(f"unknown tag {tag!r} in checkpoint state (written by a newer unbroken?)")


def is_ref(obj: Any) -> bool:
    """Is ``obj`` (an encoded value) a reference to a stored tensor?"""
    return isinstance(obj, dict) and obj.get(_TAG) == "tensor"


def _refs(obj: Any) -> Iterator[dict[str, Any]]:
    """Every ``tensor`` reference (a dict) in an encoded tree."""
    if isinstance(obj, list):
        for v in obj:
            yield from _refs(v)
    elif isinstance(obj, dict):
        if obj.get(_TAG) == "tensor":
            yield obj
            return
        for v in obj.values():
            yield from _refs(v)


def tensor_keys(tree: Any) -> set[str]:
    """The tensor keys an encoded tree refers to (what decoding it needs)."""
    return {ref["key"] for ref in _refs(tree) if isinstance(ref.get("key"), str)}


def rekey(tree: Any, mapping: Mapping[str, str]) -> Any:
    """A copy of an encoded tree whose tensor references ``k`` point to ``mapping[k]``."""
    if isinstance(tree, list):
        return [rekey(v, mapping) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if tree.get(_TAG) == "tensor":
        return {**tree, "key": mapping.get(tree["key"], tree["key"])}
    return {k: rekey(v, mapping) for k, v in tree.items()}


def _raw(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    plain = local.detach().cpu().resolve_conj().resolve_neg()  # the values, not the memory
    return plain.contiguous().reshape(-1).view(torch.uint8)


def _scalar_kind(x: Any) -> type:
    """What ``x`` is saved as: an ``IntEnum`` its int, a ``str`` subclass its string (all a
    checkpoint can hold of them); a bool stays a bool, a numpy scalar its numpy type."""
    if isinstance(x, np.generic) and not isinstance(x, str | bytes):  # np.str_ is saved a str
        return type(x)
    return next((k for k in (bool, int, float, str, bytes) if isinstance(x, k)), type(x))


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The path of the first place where ``a`` and ``b`` (state dicts, as saved and as
    decoded) differ, bit for bit (NaN equals NaN; a tuple is not a list), or None."""
    here = path or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.shape == b.shape and torch.equal(_raw(a), _raw(b))
        )  # fmt: skip
        return None if same else here
    if isinstance(a, Mapping) and isinstance(b, Mapping):  # an OrderedDict decodes as a dict
        if a.keys() != b.keys():
            return f"{here} (keys)"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}/{k}")
            if d is not None:
                return d
        return None
    if type(a) is not type(b) and _scalar_kind(a) is not _scalar_kind(b):
        return f"{here} ({type(a).__name__} vs {type(b).__name__})"
    if isinstance(a, np.ndarray):
        same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        return None if same else here
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return f"{here} (length)"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{path}/{i}")
            if d is not None:
                return d
        return None
    if isinstance(a, float) and a != a and b != b:  # NaN: the same value saved
        return None
    return None if a == b else here
