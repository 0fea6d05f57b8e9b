"""Per-tensor statistics (sum and L2 norm) that manifests of format versions 1-3 record.
Since version 4 (issue 23 item 2) a save records none (``stats_algo: "none"``,
:data:`NO_STATS`): they are a function of the bytes the file checksums already cover
(ARCHITECTURE.md, "What the statistics add") and cost about as much CPU per byte as the
checksum. The manifest names the algorithm (``stats_algo``), so recorded statistics are
always recomputed the way they were recorded (``ckpt verify --deep``; ``torch-v1`` ones on
every restore):

* ``"chunked-f64"`` (:data:`STATS_ALGO`, written by format version 3): the tensor's elements in
  chunks of :data:`CHUNK_BYTES`; each chunk reduced by torch (float32 and float64 in their
  own precision, 16- and 8-bit floats converted to float32 chunk by chunk, integers and bool
  to float64; numpy's pairwise sum and BLAS dot); the chunks' sums and sums of squares accumulated in float64. It runs over a
  chunk right after the checksum (or the write) touched the same bytes, while they are in
  the CPU cache, and a whole-tensor float32 reduction's rounding (0.05% of the norm at 16M
  elements, 0.5% at 64M) stays inside each chunk.
* ``"torch-v1"`` (:data:`LEGACY_STATS_ALGO`; manifests without ``stats_algo``): whole-tensor
  reductions in the tensor's precision. Still recomputed as such, so old checkpoints load.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import numpy as np
import torch

__all__ = [
    "CHUNK_BYTES",
    "LEGACY_STATS_ALGO",
    "NO_STATS",
    "STATS_ALGO",
    "STATS_ALGOS",
    "Stats",
    "stats_close",
    "stats_match",
    "tensor_bytes",
    "tensor_stats",
]

STATS_ALGO = "chunked-f64"
LEGACY_STATS_ALGO = "torch-v1"
NO_STATS = "none"
STATS_ALGOS = (STATS_ALGO, LEGACY_STATS_ALGO)
CHUNK_BYTES = 1 << 20  # fits a core's L2 cache next to the checksum's state


_NUMPY: dict[torch.dtype, type] = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint64: np.uint64, torch.uint32: np.uint32, torch.uint16: np.uint16,
    torch.uint8: np.uint8, torch.bool: np.bool_,
}  # fmt: skip


def tensor_bytes(t: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous CPU tensor, without a copy (None when numpy cannot view
    it, e.g. a conjugate or negative view bit)."""
    try:
        return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError):
        return None


class Stats:
    """Running :data:`STATS_ALGO` statistics of one tensor, fed its bytes chunk by chunk in
    order. Reduced with numpy: single-threaded per call (torch's intra-op threads would
    spin against the writer and hashing threads on a busy box: 14x the CPU measured)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.total = 0.0
        self.squares = 0.0
        self.count = 0

    @property
    def chunk_bytes(self) -> int:
        size = self.dtype.itemsize
        return max(size, CHUNK_BYTES - CHUNK_BYTES % size)

    def _wide(self, data: memoryview) -> np.ndarray:
        """The elements of ``data`` as float32/float64 (integers and bool as float64)."""
        if self.dtype == torch.bfloat16:  # the high half of a float32
            return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        kind = _NUMPY.get(self.dtype)
        if kind is None:  # float8: numpy has no such type
            with warnings.catch_warnings():  # read only, as the mapped file is
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return torch.frombuffer(data, dtype=self.dtype).to(torch.float32).numpy()
        x: np.ndarray = np.frombuffer(data, kind)
        if not x.flags.aligned:  # numpy's generic loops are ~20x slower than BLAS on these
            x = x.copy()
        if kind in (np.float32, np.float64):
            return x
        return x.astype(np.float32 if kind is np.float16 else np.float64)

    def add(self, data: memoryview) -> None:
        """Fold in ``data``, the next bytes of the tensor (:attr:`chunk_bytes` of them
        except the last, so every reader splits the tensor the same way)."""
        if self.dtype.is_complex or not len(data):  # no statistics (the checksum covers it)
            return
        x = self._wide(data)
        with np.errstate(all="ignore"):  # a tensor may hold inf and NaN: so do its stats
            sq = float(np.dot(x, x))
            if math.isinf(sq):  # squares overflow float32 (e.g. Adam's exp_avg_sq): go wide
                w = x.astype(np.float64)
                sq = float(np.dot(w, w))
            self.total += float(np.add.reduce(x))
        self.squares += sq
        self.count += x.size

    def result(self) -> dict[str, float] | None:
        if self.count == 0 or self.dtype.is_complex:
            return None
        return {"sum": self.total, "norm": math.sqrt(self.squares)}


def _chunked(t: torch.Tensor) -> dict[str, float] | None:
    if t.is_complex() or t.numel() == 0:
        return None
    acc = Stats(t.dtype)
    data = tensor_bytes(t.contiguous())
    if data is None:
        data = tensor_bytes(t.resolve_conj().resolve_neg().contiguous())
    if data is None:
        raise ValueError(f"cannot view a {t.dtype} tensor's bytes")
    step = acc.chunk_bytes
    for i in range(0, len(data), step):
        acc.add(data[i : i + step])
    return acc.result()


_ROW = 4096
_ONES: dict[torch.dtype, torch.Tensor] = {}


def _fast_sum(flat: torch.Tensor) -> float:
    """Sum of a 1-D float32/float64 tensor as a matrix-vector product, with float64
    accumulation across rows (the legacy algorithm; kept bit for bit)."""
    ones = _ONES.get(flat.dtype)
    if ones is None:
        ones = _ONES[flat.dtype] = torch.ones(_ROW, dtype=flat.dtype)
    n = flat.numel()
    m = n - n % _ROW
    total = 0.0
    if m:
        total += float((flat[:m].view(-1, _ROW) @ ones).sum(dtype=torch.float64))
    if n > m:
        total += float(flat[m:].sum(dtype=torch.float64))
    return total


def _legacy(t: torch.Tensor) -> dict[str, float] | None:
    """The ``torch-v1`` statistics: whole-tensor reductions in the tensor's precision."""
    if t.is_complex() or t.numel() == 0:
        return None
    t = t.detach()
    if t.dtype in (torch.float32, torch.float64):
        flat = t.reshape(-1)
        norm = float(torch.linalg.vector_norm(flat))
        if math.isinf(norm):
            norm = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
        return {"sum": _fast_sum(flat), "norm": norm}
    if t.is_floating_point() and t.element_size() == 1:  # float8: no promotion rules
        t = t.to(torch.float32)
    if t.is_floating_point():
        return {
            "sum": float(torch.sum(t, dtype=torch.float32)),
            "norm": float(torch.linalg.vector_norm(t, dtype=torch.float32)),
        }
    t = t.to(torch.float64)
    return {"sum": float(t.sum()), "norm": float(torch.linalg.vector_norm(t))}


def tensor_stats(t: torch.Tensor, algo: str = STATS_ALGO) -> dict[str, float] | None:
    """Sum and L2 norm of ``t`` by ``algo`` (one of :data:`STATS_ALGOS`); None for complex
    and empty tensors."""
    if algo == STATS_ALGO:
        return _chunked(t)
    if algo == LEGACY_STATS_ALGO:
        return _legacy(t)
    raise ValueError(f"stats algorithm {algo!r} is not one of {STATS_ALGOS}")


def _close(a: float, b: float, tol: float) -> bool:
    if math.isnan(a) or math.isnan(b):  # a tensor may legitimately hold NaN/inf
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol


def stats_close(
    expected: Mapping[str, float] | None, got: Mapping[str, float] | None, numel: int
) -> bool:
    """Do statistics recomputed over ``numel`` elements match the recorded ones, up to the
    rounding a different reduction order (or memory alignment) may cause?"""
    if expected is None or got is None:
        return expected is None and got is None
    norm = expected["norm"]
    if not _close(got["norm"], norm, 1e-5 * abs(norm) + 1e-30):
        return False
    # |sum| <= sqrt(n) * norm bounds the reduction-order rounding of the sum.
    tol = 1e-5 * (numel**0.5) * abs(norm) if math.isfinite(norm) else 0.0
    return _close(got["sum"], expected["sum"], tol + 1e-5 * abs(expected["sum"]) + 1e-30)


def stats_match(
    expected: Mapping[str, float] | None, t: torch.Tensor, algo: str = STATS_ALGO
) -> bool:
    return stats_close(expected, tensor_stats(t, algo), t.numel())
