"""`StreamingDataset`: an IterableDataset over packed tar shards or token shards.

What a rank sees is fixed by the epoch order (:mod:`unbroken.data.stream.order`) and by the
partition of one *run* (the positions from the resume point to the epoch end):

* global step ``s`` of a run covers positions ``start + s*G .. start + (s+1)*G - 1`` with
  ``G = world_size * batch_size``; rank ``r`` takes every ``world_size``-th of them, starting
  at offset ``r`` (:class:`~unbroken.data.stream.order.Partition`);
* the rank's ``b``-th batch is built by DataLoader worker ``b % num_workers``, which is the
  order in which ``torch.utils.data.DataLoader`` (``in_order=True``) collects batches from
  its workers. Workers yield whole, collated batches (the DataLoader runs with
  ``batch_size=None``), so the batches a rank receives do not depend on ``num_workers`` or
  ``prefetch_factor``.

A worker reads only the samples of its own batches: per batch, reads are sorted by
(shard, index), and a batch's samples come from one shuffle window, i.e. a contiguous run of a
few shards (D-IO). Shards are dealt to workers afresh every epoch, because the shard order and
the windows change with the epoch (D-SHUFFLE).

Samples: a tar dataset yields ``{"__key__": str, "<ext>": bytes, ...}`` (as ``ShardReader``
returns); a token dataset yields ``np.int64`` arrays of ``seq_len + 1`` tokens (inputs and
shifted targets, nanoGPT-style). ``transform`` (a picklable callable) is applied to every
sample in the worker. Its randomness is reproducible: python's, numpy's and torch's global CPU
RNGs are seeded from (seed, epoch, position of the batch's first sample) before each batch is
transformed, so random augmentations are the same after a resume and for any
``num_workers`` (with ``num_workers=0`` the training process's RNG states are put back).

Sample ids (``with_ids=True``): every sample carries its id, its index in the concatenation of
the sources' manifests (source 0's samples first, each source in ``dataset.json`` order) - the
same sample has the same id in every epoch, on any world size and ``num_workers``, so a log of
ids proves the data order (what ``unbroken drill`` compares) without hashing samples. A dict
sample (tar, or a transform that returns a dict) gains ``"__id__": int``; any other sample
(token rows, a transform's tensor) becomes the pair ``(sample, id)``. With the default collate a
batch of dicts has ``batch["__id__"]`` (a LongTensor of B ids) and a token batch is
``tokens, ids = batch`` (LongTensors ``(B, seq_len + 1)`` and ``(B,)``). The id is attached
after ``transform``, and crosses the loader's transport like any other field.

Several sources can be mixed with weights (``sources=[Source(a, 0.7), Source(b, 0.3)]``); the
mixture is part of the deterministic order (:class:`~unbroken.data.stream.order.MixtureOrder`).
An epoch of a mixture has ``samples_per_epoch`` positions (default: the sum of the sources'
sizes); a source that runs out within an epoch continues with a fresh shuffle of itself.

Every sample byte is verified on read (``verify=True``, the default; T-NO-WRONG-BYTE): a tar
member against the xxh3_64 its shard index recorded, a token sequence against the hashes of
the 64 Ki-token blocks under it (each block once per worker), and each index against the
checksum ``dataset.json`` records for it, when its shard is opened. Damage raises
:class:`~unbroken.data.tar.reader.CorruptSampleError` naming dataset, shard, sample key and member
(or token block); with ``on_corrupt="skip"`` the sample is left out of its batch (which is
then shorter; one whose every sample is damaged arrives as an empty list), logged and counted
in :attr:`StreamingDataset.corrupt_skipped` (``StatefulLoader.stats()``).

Use it through :class:`unbroken.data.stream.loader.StatefulLoader`, which adds batching, workers and
the resume state. Iterated on its own (or by ``DataLoader(ds, batch_size=None)``) it yields the
rank's samples one by one from :meth:`set_epoch`'s epoch.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing as mp
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import context as mp_context
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch.utils.data import IterableDataset, get_worker_info

from unbroken.common.fs import is_remote, local_path
from unbroken.data.manifest import DatasetManifest
from unbroken.data.stream.cache import (
    CacheOptions,
    check_cache_args,
    load_remote_manifest,
    open_cache,
)
from unbroken.data.stream.order import (
    EpochOrder,
    MixtureOrder,
    Partition,
    default_shuffle_window,
    mix_seed,
    mix_seeds,
    shards_per_window,
)
from unbroken.data.tar.reader import (
    ShardError,
    ShardReader,
    cached_fix,
    corrupt_sample,
    index_format,
    warn_unverified,
)
from unbroken.data.tokens.shard import TokenShard, num_sequences

__all__ = ["ON_CORRUPT", "CacheOptions", "Source", "StreamingDataset"]

ON_CORRUPT = ("raise", "skip")
T = TypeVar("T")
_FEW = 8  # a shard's first read of up to this many samples skips building its row table
_xxh64 = xxhash.xxh3_64_intdigest  # the member checksum of a shard index (shards.py)

log = logging.getLogger(__name__)

# Open shards kept per worker and source: at least this many, and always every shard one
# shuffle window can touch (reads move window by window, so nothing is reopened inside one).
_MIN_OPEN = 8
_ORDER_CACHE = 8
_RNG_TAG = 0x5EED  # seed material of the transform's RNGs (vs the order's)
_SEED_CHUNK = 64  # batches whose RNG seeds iter_batches computes at once


def _batch_seeds(seed: int, epoch: int, firsts: list[int]) -> list[int]:
    """:func:`_seeded_rngs`'s seeds for reads starting at positions ``firsts``, at once."""
    return mix_seeds((seed, epoch), np.asarray(firsts, np.int64), (_RNG_TAG,)).tolist()


@contextlib.contextmanager
def _seeded_rngs(seed: int, epoch: int, position: int, s: int | None = None) -> Iterator[None]:
    """Seed python's, numpy's and torch's global CPU RNGs for one read of samples.

    Random augmentations in ``transform`` then depend only on (seed, epoch, position of the
    read's first sample): the same after a resume, for any ``num_workers``. In a DataLoader
    worker the RNGs belong to the data pipeline; in the training process (``num_workers=0``)
    they are the model's, so they are put back afterwards and training draws stay the same.
    ``s``: the seed, when the caller computed it (:func:`_batch_seeds`).
    """
    if s is None:
        s = mix_seed(seed, epoch, position, _RNG_TAG)
    gen = torch.default_generator  # not torch.manual_seed: that also seeds every device
    saved = None
    if get_worker_info() is None:
        saved = (random.getstate(), np.random.get_state(), gen.get_state())
    random.seed(s)
    np.random.seed(s & 0xFFFFFFFF)
    gen.manual_seed(s)
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            gen.set_state(saved[2])


@dataclass(frozen=True)
class Source:
    """One dataset in a (possibly single-element) mixture.

    root: a local directory holding ``dataset.json``, or an fsspec URL (``s3://bucket/ds``)
        whose shards are read through the node's bounded cache (``StreamingDataset``'s
        ``cache_dir``/``cache_limit``; see :mod:`unbroken.data.stream.cache`).
    weight: relative share of the mixture's positions (any positive scale; normalised).
    seq_len: token datasets only: tokens per sequence (a sample is ``seq_len + 1`` tokens);
        default: the ``seq_len`` the dataset was tokenized with.
    storage_options: fsspec options for a URL root (endpoint, credentials); default: the
        dataset's ``storage_options``.
    """

    root: str
    weight: float = 1.0
    seq_len: int | None = None
    storage_options: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise ValueError(f"Source root={self.root!r} must be a non-empty path string")
        if not self.weight > 0:
            raise ValueError(f"Source {self.root}: weight={self.weight} must be > 0")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"Source {self.root}: seq_len={self.seq_len} must be >= 1")


class _Reader:
    """Sample access for one source: per-shard counts, fingerprint, batched reads.

    ``read`` returns the samples of one shard; with ``verify`` each is checked, and a damaged
    one raises (``on_corrupt="raise"``) or comes back as None (``"skip"``).
    """

    counts: np.ndarray
    fingerprint: str
    fingerprint_v1: str  # as dataset.json version 1 defined it: named when a state carries it
    manifest: DatasetManifest
    cache: Any = None  # a RemoteCache when the source is remote: it opens (pins) the shards
    verify: bool = True
    on_corrupt: str = "raise"

    def __init__(self, root: str, manifest: DatasetManifest) -> None:
        self.root = root
        self.manifest = manifest
        self._open: OrderedDict[int, Any] = OrderedDict()
        self.max_open = _MIN_OPEN

    def _set_counts(self, counts: list[int]) -> None:
        self.counts = np.array(counts, dtype=np.int64)
        self._starts = np.zeros(self.counts.size + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self._starts[1:])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample ids (manifest order) -> (shard, index in shard)."""
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        return shard, ids - self._starts[shard]

    def _path(self, shard: int) -> str:
        return os.path.join(self.root, self.manifest.shards[shard].name)

    def _shard(self, shard: int) -> Any:
        r = self._open.get(shard)
        if r is None:
            r = self._open_shard(shard) if self.cache is None else self.cache.open(self, shard)
            self._open[shard] = r
            if len(self._open) > self.max_open:
                _, old = self._open.popitem(last=False)
                close = getattr(old, "close", None)
                if close is not None:
                    close()
        else:
            self._open.move_to_end(shard)
        return r

    def _open_shard(self, shard: int) -> Any:
        raise NotImplementedError

    def read(self, shard: int, local: np.ndarray) -> list[Any]:
        raise NotImplementedError

    def warn_if_unverified(self) -> None:
        """One WARNING per dataset, in this process (workers inherit it), when its indexes
        predate checksums: peeks at the first shard's index magic (8 bytes)."""
        if not self.verify or not self.manifest.shards:
            return
        path = os.path.join(self.root, self.manifest.shards[0].index)
        try:
            with open(path, "rb") as f:
                magic = f.read(8)
        except OSError:
            return  # not there (yet): opening the shard reports it
        if index_format(magic) == 1:
            warn_unverified(self.root, path)

    def _fix(self, shard: int) -> str:
        """What to do about a shard that is damaged or does not match dataset.json."""
        if self.cache is not None:
            return cached_fix(self._path(shard))
        return "re-copy the dataset (`unbroken data stage` verifies what it copies)"

    def _open_with(self, cls: Callable[..., T], shard: int) -> T:
        """``cls(shard file, its index, ...)`` (a tar or token shard reader) with this
        dataset's verification settings; an OS error names the shard and the fix."""
        info = self.manifest.shards[shard]
        try:
            return cls(
                self._path(shard),
                os.path.join(self.root, info.index),
                verify=self.verify,
                index_checksum=info.index_checksum,
                dataset=self.root,
                cached=self.cache is not None,
            )
        except OSError as e:
            raise ShardError(
                f"dataset {self.root}: shard {info.name} cannot be opened ({e}); {self._fix(shard)}"
            ) from None

    def __getstate__(self) -> dict[str, Any]:
        # Open files are per process; a worker started by spawn/forkserver reopens lazily.
        d = dict(self.__dict__)
        d["_open"] = OrderedDict()
        return d


class _TarReader(_Reader):
    def __init__(self, source: Source, root: str, manifest: DatasetManifest) -> None:
        super().__init__(root, manifest)
        if source.seq_len is not None:
            raise ValueError(
                f"{source.root}: seq_len={source.seq_len} applies to token datasets only; "
                "this is a tar dataset - drop seq_len"
            )
        self._set_counts([s.samples for s in manifest.shards])
        self.fingerprint = manifest.fingerprint
        self.fingerprint_v1 = manifest.fingerprint_v1

    def _open_shard(self, shard: int) -> _MappedShard:
        info = self.manifest.shards[shard]
        r = self._open_with(ShardReader, shard)
        if self.verify and (r.index.tar_bytes, r.index.tar_checksum) != (info.bytes, info.checksum):
            r.close()
            raise ShardError(
                f"dataset {self.root}: shard {info.name}: its index describes a tar of "
                f"{r.index.tar_bytes} bytes with checksum {r.index.tar_checksum}, dataset.json "
                f"one of {info.bytes} bytes with checksum {info.checksum}; {self._fix(shard)}"
            )
        return _MappedShard(r, skip=self.on_corrupt == "skip")

    def read(self, shard: int, local: np.ndarray) -> list[Any]:
        return self._shard(shard).read(local)


class _MappedShard:
    """A shard's index (from ``ShardReader``, which validated it against the tar) plus an
    mmap of the tar: a sample is a few slices of the map - no syscall, no tar parsing.

    Same samples as ``ShardReader[i]``; slicing costs ~1 us where a ``pread`` per sample costs
    several, which is most of a worker's time at 4 KB samples. When every sample of the shard
    has the same extensions in the same order (the usual case), their names are decoded once
    and one row per sample - key span, each member's data span and, when verifying, each
    member's xxh3_64 - is gathered for a whole group of samples with a single numpy indexing.
    Each member is hashed right after it is sliced, in the same loop (a separate pass over
    the group's samples cost as much again as the hashing; measured in RESULTS.md).
    """

    def __init__(self, reader: ShardReader, *, skip: bool = False) -> None:
        self.reader = reader
        self.skip = skip
        idx = reader.index
        self.verifies = reader.verifies
        with open(reader.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self.index = idx
        self.strings = idx.strings
        self.exts: tuple[str, ...] | None = None
        self.text = ""  # uniform layout: the keys, decoded
        # uniform layout, per sample: key start, key end (in `text`), each member's data
        # start and end, then (verifying) each member's checksum; uint64: tolist() gives ints
        self.rows: np.ndarray | None = None
        self._planned = False
        self._first_done = False  # a first small read goes without the table

    def _plan(self) -> None:
        """Decide the layout and build the row table (or, for any other layout, the index as
        lists); ~0.3 ms for a 64 MB shard, so a shard read once for a few samples (the first
        batch after a resume touches many shards) skips it."""
        self._planned = True
        idx = self.index
        ms = np.asarray(idx.member_start, dtype=np.int64)
        eo = np.asarray(idx.ext_off, dtype=np.int64)
        n = ms.size - 1
        k = int(ms[1]) if n > 0 else 0
        if k > 0 and bool((np.diff(ms) == k).all()):
            first = self.strings[eo[0] : eo[k]]
            lens = np.diff(eo).reshape(n, k)
            if self.strings[eo[0] :] == first * n and bool((lens == lens[0]).all()):
                self.exts = tuple(self.strings[eo[j] : eo[j + 1]].decode() for j in range(k))
                ko = np.asarray(idx.key_off, dtype=np.int64)
                # Keys are sliced from one str (one object per key instead of a bytes slice
                # and its decode): offsets in characters, i.e. bytes minus the UTF-8
                # continuation bytes before them (ShardIndex checked that every key decodes).
                keys = self.strings[: int(ko[-1])]
                self.text = keys.decode()
                if not keys.isascii():
                    cont = (np.frombuffer(keys, np.uint8) & 0xC0) == 0x80
                    ko = ko - np.concatenate(([0], np.cumsum(cont)))[ko]
                off = np.asarray(idx.data_offset, dtype=np.int64).reshape(n, k)
                rows = np.empty((n, 2 + 2 * k + (k if self.verifies else 0)), dtype=np.uint64)
                rows[:, 0] = ko[:-1]
                rows[:, 1] = ko[1:]
                rows[:, 2 : 2 + 2 * k : 2] = off
                rows[:, 3 : 2 + 2 * k : 2] = off + np.asarray(idx.data_size).reshape(n, k)
                if self.verifies:
                    rows[:, 2 + 2 * k :] = np.asarray(idx.member_hash).reshape(n, k)
                self.rows = rows
                return
        self.reader._tables()  # Python ints for _read_any's per-member lookups

    def read(self, local: np.ndarray) -> list[Any]:
        """Samples ``local`` of this shard; None for a damaged one when skipping."""
        rows, exts = self.rows, self.exts
        if rows is None or exts is None:
            if not self._planned and (self._first_done or len(local) > _FEW):
                self._plan()
                return self.read(local)
            self._first_done = True
            return self._read_any(local.tolist())
        mm, text, h = self.mm, self.text, _xxh64
        out: list[Any] = []
        bad: list[int] = []  # positions in `out` whose bytes do not match their checksums
        if not self.verifies and len(exts) <= 2:
            if len(exts) == 1:
                (x,) = exts
                for a, b, o, e in rows.take(local, 0).tolist():
                    out.append({"__key__": text[a:b], x: mm[o:e]})
            else:
                x, y = exts
                for a, b, o, e, p, q in rows.take(local, 0).tolist():
                    out.append({"__key__": text[a:b], x: mm[o:e], y: mm[p:q]})
        elif len(exts) == 1:
            (x,) = exts
            for a, b, o, e, w in rows.take(local, 0).tolist():
                v = mm[o:e]
                if h(v) != w:
                    bad.append(len(out))
                out.append({"__key__": text[a:b], x: v})
        elif len(exts) == 2:
            x, y = exts
            for a, b, o, e, p, q, w, z in rows.take(local, 0).tolist():
                v, u = mm[o:e], mm[p:q]
                if h(v) != w or h(u) != z:
                    bad.append(len(out))
                out.append({"__key__": text[a:b], x: v, y: u})
        else:
            k = len(exts)
            cols = [(x, 2 + 2 * j, 3 + 2 * j, 2 + 2 * k + j) for j, x in enumerate(exts)]
            verify = self.verifies
            for r in rows.take(local, 0).tolist():
                d: dict[str, Any] = {"__key__": text[r[0] : r[1]]}
                ok = True
                for x, s, t, c in cols:
                    v = d[x] = mm[r[s] : r[t]]
                    if verify and ok and h(v) != r[c]:
                        ok = False
                if not ok:
                    bad.append(len(out))
                out.append(d)
        return self._damaged(out, bad, local) if bad else out

    def _read_any(self, local: list[int]) -> list[Any]:
        """Any layout: members and extensions looked up per sample."""
        # lists once planned; before, the index's numpy views (a few samples: no tables)
        lists = self.reader._lists
        ms, ko, off, size, eo = lists if lists is not None else self.index._tables()
        hashes = None
        if self.verifies:
            hashes = self.reader._hashes if lists is not None else self.index.member_hash
        mm, strings, h = self.mm, self.strings, _xxh64
        cache: dict[bytes, str] = {}
        out: list[Any] = []
        bad: list[int] = []
        for i in local:
            d: dict[str, Any] = {"__key__": strings[ko[i] : ko[i + 1]].decode()}
            ok = True
            for j in range(ms[i], ms[i + 1]):
                raw = strings[eo[j] : eo[j + 1]]
                ext = cache.get(raw)
                if ext is None:
                    ext = cache[raw] = raw.decode()
                o = off[j]
                v = d[ext] = mm[o : o + size[j]]
                if hashes is not None and ok and h(v) != hashes[j]:
                    ok = False
            if not ok:
                bad.append(len(out))
            out.append(d)
        return self._damaged(out, bad, local) if bad else out

    def _damaged(self, out: list[Any], bad: list[int], local: Any) -> list[Any]:
        """Raise for the first damaged sample, naming its first damaged member, or (when
        skipping) log each and put None in its place."""
        idx, mm = self.index, self.mm
        for p in bad:
            i = int(local[p])
            a, b = int(idx.member_start[i]), int(idx.member_start[i + 1])
            wrong = [
                idx.ext(j)
                for j in range(a, b)
                if _xxh64(mm[int(idx.data_offset[j]) : int(idx.data_offset[j] + idx.data_size[j])])
                != int(idx.member_hash[j])  # type: ignore[index]
            ]
            err = corrupt_sample(
                self.reader.path,
                f"sample {out[p]['__key__']!r} member {wrong[0]!r}"
                if wrong
                else f"sample {out[p]['__key__']!r} (its bytes changed while it was read)",
                dataset=self.reader.dataset,
                cached=self.reader.cached,
            )
            if not self.skip:
                raise err
            log.warning("%s; skipped (on_corrupt='skip')", err)
            out[p] = None
        return out

    def close(self) -> None:
        if isinstance(self.mm, mmap.mmap):
            self.mm.close()
        self.reader.close()


class _TokenReader(_Reader):
    def __init__(
        self, source: Source, root: str, manifest: DatasetManifest, default_seq_len: int | None
    ) -> None:
        super().__init__(root, manifest)
        m = manifest
        seq_len = source.seq_len or default_seq_len or m.seq_len
        if seq_len is None:
            raise ValueError(
                f"{source.root}: token dataset without a seq_len (tokenized unpacked); pass "
                "seq_len=... to StreamingDataset or Source"
            )
        self.seq_len = int(seq_len)
        self.fingerprint_v1 = m.fingerprint_v1
        if self.seq_len == m.seq_len:
            self._set_counts([s.samples for s in m.shards])
            self.fingerprint = m.fingerprint
        else:
            counts = []
            for i, s in enumerate(m.shards):
                tokens = s.tokens if s.tokens is not None else TokenShard(self._path(i)).num_tokens
                counts.append(num_sequences(tokens, self.seq_len))
            self._set_counts(counts)
            # A different seq_len makes different samples: it is a different dataset.
            self.fingerprint, self.fingerprint_v1 = (
                xxhash.xxh3_128_hexdigest(f"{f}/seq_len={self.seq_len}".encode())
                for f in (m.fingerprint, m.fingerprint_v1)
            )
        self._span = np.arange(self.seq_len + 1, dtype=np.int64)

    def _open_shard(self, shard: int) -> TokenShard:
        info, m = self.manifest.shards[shard], self.manifest
        ts = self._open_with(TokenShard, shard)
        want = (m.dtype, m.eos_id, info.bytes, info.checksum)
        have = (ts.dtype.name, ts.eos_id, ts.tokens.nbytes, ts.checksum)
        if self.verify and have != want:
            raise ShardError(
                f"dataset {self.root}: shard {info.name}: its index says (dtype, eos_id, bytes, "
                f"checksum) = {have}, dataset.json {want}; {self._fix(shard)}"
            )
        return ts

    def read(self, shard: int, local: np.ndarray) -> list[Any]:
        ts = self._shard(shard)
        starts = local * self.seq_len
        bad = ts.damaged(starts, self.seq_len + 1)  # None unless a block under them is damaged
        if bad is not None and self.on_corrupt == "raise":
            raise ts.error(int(starts[np.flatnonzero(bad)[0]]), self.seq_len + 1)
        # One gather for the whole group, then rows; int64 like nanoGPT's get_batch.
        rows: list[Any] = list(np.asarray(ts.tokens[starts[:, None] + self._span], dtype=np.int64))
        if bad is not None:
            idx = np.flatnonzero(bad).tolist()
            log.warning(
                "%s; skipped %d sequences (on_corrupt='skip')",
                ts.error(int(starts[idx[0]]), self.seq_len + 1),
                len(idx),
            )
            for i in idx:
                rows[i] = None
        return rows


def _open_reader(
    source: Source,
    seq_len: int | None,
    storage_options: dict[str, Any] | None = None,
    cache_options: CacheOptions | None = None,
) -> _Reader:
    if is_remote(source.root):
        # The reader's root becomes its local cache directory in open_cache().
        root = source.root
        opts = source.storage_options if source.storage_options is not None else storage_options
        manifest = load_remote_manifest(root, opts, cache_options or CacheOptions())
        if manifest.kind == "tokens" and any(s.tokens is None for s in manifest.shards):
            raise ValueError(
                f"{root}: the manifest lacks per-shard token counts (an old `unbroken "
                "tokenize`); re-tokenize, or stage it with `unbroken data stage` and read it locally"
            )
    else:
        root = local_path(source.root)
        manifest = DatasetManifest.load(root)
    if manifest.kind == "tar":
        return _TarReader(source, root, manifest)
    return _TokenReader(source, root, manifest, seq_len)


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"rank={rank} world_size={world_size}: pass both or neither (neither: taken from "
            "torch.distributed, or 0 and 1 when it is not initialized)"
        )
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} world_size={world_size}: need 0 <= rank < world_size")
    return int(rank), int(world_size)


def _read_ids(reader: _Reader, ids: np.ndarray) -> list[Any]:
    """Samples ``ids`` (manifest order) of one source, in the order given; read shard by
    shard, each shard's samples in index order (sequential inside a shard, D-IO). Sorting
    the ids once sorts by (shard, index): a shard is a contiguous run of ids."""
    n = len(ids)
    if n == 0:
        return []
    order = np.argsort(ids, kind="stable")
    shard, local = reader.locate(ids[order])
    if shard[0] == shard[-1]:
        got = reader.read(int(shard[0]), local)
    else:
        cuts = (np.flatnonzero(shard[1:] != shard[:-1]) + 1).tolist()
        got = []
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):
            got += reader.read(int(shard[a]), local[a:b])
    out: list[Any] = [None] * n
    for dst, smp in zip(order.tolist(), got, strict=True):
        out[dst] = smp
    return out


class StreamingDataset(IterableDataset):
    """Deterministic, resumable stream over one or several packed datasets (module docstring).

    Args:
        sources: a dataset directory, a :class:`Source`, or a list of them to mix by weight.
        seed: shuffle seed (non-negative int); with the fingerprint and epoch it fixes the order.
        shuffle: ``False`` reads every epoch in manifest order.
        shuffle_window: samples per shuffle window; default four times the largest shard (a
            window mixes at least four shards) and at least 256 Ki samples (smaller datasets
            are shuffled globally), capped at 4 Mi. Memory per worker: ``8 * shuffle_window``
            bytes.
        transform: per-sample function run in the worker (decode, augment); picklable.
            The global CPU RNGs it draws from are seeded per batch (see the module docstring).
        seq_len: token datasets: tokens per sequence (default: the tokenized ``seq_len``).
        rank, world_size: this process's share; default from ``torch.distributed``.
        samples_per_epoch: mixtures only: positions per epoch (default: sum of source sizes).
        mix_block: mixtures only: slots per mixture block (the smallest weight must get >= 1).
        with_ids: attach each sample's id (module docstring: ``batch["__id__"]`` for dict
            samples, ``(sample, id)`` pairs otherwise).
        verify: check every sample's bytes (and each shard index) against the checksums
            recorded when the dataset was written (default True; see the module docstring).
        on_corrupt: ``"raise"`` (default) a :class:`~unbroken.data.tar.reader.CorruptSampleError`
            naming dataset, shard, sample and member; ``"skip"`` leaves the sample out of its
            batch, logs it and counts it in :attr:`corrupt_skipped`.
        cache_dir: remote sources (fsspec URLs): local directory of the node's shard cache,
            shared by its ranks and workers (:mod:`unbroken.data.stream.cache`).
        cache_limit: bytes the cache may hold (``"200GB"``, ``"1TiB"`` or an int; None:
            unbounded); refused at start when smaller than two shuffle windows plus prefetch.
        storage_options: fsspec options for remote sources (endpoint, credentials).
        cache_options: prefetch depth, download threads, timeout, retries
            (:class:`~unbroken.data.stream.cache.CacheOptions`).
    """

    def __init__(
        self,
        sources: str | Source | Sequence[str | Source],
        *,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_window: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        seq_len: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        samples_per_epoch: int | None = None,
        mix_block: int = 4096,
        with_ids: bool = False,
        verify: bool = True,
        on_corrupt: str = "raise",
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_options: CacheOptions | None = None,
    ) -> None:
        super().__init__()
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"on_corrupt={on_corrupt!r} is not one of {ON_CORRUPT}")
        if seq_len is not None and seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1 (tokens per sequence)")
        if isinstance(sources, (str, Source)):
            sources = [sources]
        srcs = [s if isinstance(s, Source) else Source(s) for s in sources]
        if not srcs:
            raise ValueError("sources is empty; pass a dataset directory or a list of Source")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative int")
        if shuffle_window is not None and shuffle_window < 1:
            raise ValueError(f"shuffle_window={shuffle_window} must be >= 1 (or None)")
        self.sources = tuple(srcs)
        self.seed = seed
        self.shuffle = shuffle
        self.transform = transform
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        check_cache_args([s.root for s in srcs], cache_dir, cache_limit)  # before any download
        self._readers = [_open_reader(s, seq_len, storage_options, cache_options) for s in srcs]
        self.verify = bool(verify)
        self.on_corrupt = on_corrupt
        for r in self._readers:
            # A remote reader verifies what it reads from the cache exactly like a local one
            # (the download itself is checked against dataset.json's checksums first).
            r.verify, r.on_corrupt = self.verify, on_corrupt
            r.warn_if_unverified()
        self._skipped = _SharedCount() if on_corrupt == "skip" else None
        for s, r in zip(srcs, self._readers, strict=True):
            if int(r.counts.sum()) == 0:
                raise ValueError(f"{s.root}: the dataset holds no samples")
        self.kind = self._readers[0].manifest.kind
        self.shuffle_window = [
            (shuffle_window or default_shuffle_window(r.counts)) if shuffle else 0
            for r in self._readers
        ]
        for r, w in zip(self._readers, self.shuffle_window, strict=True):
            r.max_open = max(_MIN_OPEN, shards_per_window(r.counts, w or 1) + 1)
        sizes = [int(r.counts.sum()) for r in self._readers]
        if len(srcs) == 1:
            if samples_per_epoch is not None:
                raise ValueError(
                    "samples_per_epoch applies to mixtures of several sources; an epoch of one "
                    f"dataset is its {sizes[0]} samples - drop samples_per_epoch"
                )
            self.epoch_length = sizes[0]
            self.fingerprint = self._readers[0].fingerprint
            self._weights: tuple[float, ...] = (1.0,)
        else:
            if samples_per_epoch is not None and samples_per_epoch < 1:
                raise ValueError(f"samples_per_epoch={samples_per_epoch} must be >= 1")
            self.epoch_length = int(samples_per_epoch or sum(sizes))
            # Validates the weights against mix_block now, not in a worker.
            probe = MixtureOrder([s.weight for s in srcs], "", 0, 0, 1, block=mix_block)
            self._weights = probe.weights
            parts = [
                f"{r.fingerprint}:{w!r}" for r, w in zip(self._readers, self._weights, strict=True)
            ]
            self.fingerprint = xxhash.xxh3_128_hexdigest(
                ("mix/" + ",".join(parts) + f"/{self.epoch_length}/{mix_block}").encode()
            )
        self.mix_block = mix_block
        self.with_ids = bool(with_ids)
        self._sizes = sizes
        self._id_base = np.cumsum([0, *sizes[:-1]], dtype=np.int64)  # source -> first id
        self._epoch = 0
        self._orders: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._cache = open_cache(self, cache_dir, cache_limit, cache_options, storage_options)

    # --- the order ---------------------------------------------------------------------------

    @property
    def source_fingerprints(self) -> tuple[str, ...]:
        return tuple(r.fingerprint for r in self._readers)

    @property
    def source_fingerprints_v1(self) -> tuple[str, ...]:
        """Each source's fingerprint as unbroken computed it before issue 20 (dataset.json
        version 1, not covering the indexes): a resume state saved then carries it."""
        return tuple(r.fingerprint_v1 for r in self._readers)

    @property
    def weights(self) -> tuple[float, ...]:
        return self._weights

    def _cached(self, key: tuple[int, ...], make: Callable[[], Any]) -> Any:
        hit = self._orders.get(key)
        if hit is None:
            hit = make()
            self._orders[key] = hit
            if len(self._orders) > _ORDER_CACHE:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return hit

    def _source_order(self, i: int, epoch: int, salt: tuple[int, ...]) -> EpochOrder:
        r = self._readers[i]
        return self._cached(
            (i, epoch, *salt),
            lambda: EpochOrder(
                r.counts,
                r.fingerprint,
                self.seed,
                epoch,
                shuffle=self.shuffle,
                shuffle_window=self.shuffle_window[i] or None,
                salt=salt,
            ),
        )

    def _pass_order(self, i: int, epoch: int, k: int) -> EpochOrder:
        """Source ``i``'s ``k``-th pass inside epoch ``epoch`` (as :meth:`lookup` keys it)."""
        return self._source_order(i, epoch, () if len(self._readers) == 1 else (i, k))

    def lookup(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Epoch positions -> (source index, sample id in that source's manifest order)."""
        pos = np.asarray(positions, dtype=np.int64)
        if len(self._readers) == 1:
            return np.zeros_like(pos), self._source_order(0, epoch, ()).ids(pos)
        mix: MixtureOrder = self._cached(
            (-1, epoch),
            lambda: MixtureOrder(
                self._weights,
                self.fingerprint,
                self.seed,
                epoch,
                self.epoch_length,
                block=self.mix_block,
            ),
        )
        src, off = mix.assign(pos)
        ids = np.empty_like(pos)
        for i in np.unique(src).tolist():
            sel = src == i
            n = self._sizes[i]
            rep, rest = np.divmod(off[sel], n)
            part = np.empty_like(rest)
            for k in np.unique(rep).tolist():
                # (source, k): the k-th pass over source i inside this mixture epoch
                m = rep == k
                part[m] = self._source_order(i, epoch, (i, k)).ids(rest[m])
            ids[sel] = part
        return src, ids

    @property
    def corrupt_skipped(self) -> int:
        """Damaged samples left out so far (``on_corrupt="skip"``), summed over the workers."""
        return 0 if self._skipped is None else self._skipped.value

    def read(self, epoch: int, positions: np.ndarray) -> list[Any]:
        """The samples at ``positions`` of ``epoch``, in that order, transformed (with
        ``on_corrupt="skip"``, without the damaged ones)."""
        return self._read(epoch, positions, None)

    def _read(self, epoch: int, positions: np.ndarray, rng_seed: int | None) -> list[Any]:
        if self._cache is not None:
            self._cache.advance(epoch, positions)  # prefetch from here; release what is done
        if len(self._readers) == 1:  # (lookup's per-source split, without its numpy calls)
            ids = self._source_order(0, epoch, ()).ids(np.asarray(positions, dtype=np.int64))
            out = _read_ids(self._readers[0], ids)
            gid = ids
        else:
            src, ids = self.lookup(epoch, positions)
            out = [None] * len(ids)
            for i in np.unique(src).tolist():
                sel = np.flatnonzero(src == i)
                got = _read_ids(self._readers[i], ids[sel])
                for dst, smp in zip(sel.tolist(), got, strict=True):
                    out[dst] = smp
            gid = self._id_base[src] + ids
        kept = positions  # positions of the samples in `out`
        gids = gid.tolist() if self.with_ids else []
        if self._skipped is not None and any(smp is None for smp in out):
            keep = [k for k, smp in enumerate(out) if smp is not None]
            self._skipped.add(len(out) - len(keep))
            kept, out = np.asarray(positions)[keep], [out[k] for k in keep]
            gids = [gids[k] for k in keep] if self.with_ids else []
        if self.transform is not None and len(out):
            fn = self.transform
            with _seeded_rngs(self.seed, epoch, int(positions[0]), rng_seed):
                for k, smp in enumerate(out):
                    try:
                        out[k] = fn(smp)
                    except Exception as e:
                        raise RuntimeError(
                            f"transform {getattr(fn, '__name__', fn)!r} failed on "
                            f"{_describe(smp)} (epoch {epoch}, position {int(kept[k])}): "
                            f"{e!r}"
                        ) from e
        if self.with_ids:
            for k, smp in enumerate(out):
                if isinstance(smp, dict):
                    smp["__id__"] = gids[k]
                else:
                    out[k] = (smp, gids[k])
        return out

    # --- iteration -----------------------------------------------------------------------

    def partition(self, start: int, batch_size: int, last_batch: str = "pad") -> Partition:
        """This rank's share of the run from position ``start`` to the epoch end."""
        return Partition(
            start, self.epoch_length, batch_size, self.rank, self.world_size, last_batch
        )

    def iter_batches(
        self,
        epoch: int,
        start: int,
        batch_size: int,
        *,
        last_batch: str = "pad",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_id: int = 0,
        num_workers: int = 1,
        first: int = 0,
    ) -> Iterator[Any]:
        """Batches ``first + worker_id, first + worker_id + num_workers, ...`` of this rank's
        run (``first``: batches made elsewhere, e.g. by the loader while its workers start)."""
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id={worker_id} num_workers={num_workers}")
        part = self.partition(start, batch_size, last_batch)
        try:
            mine = range(first + worker_id, part.num_batches(), num_workers)
            for c in range(0, len(mine), _SEED_CHUNK):
                batches = [part.batch_positions(b) for b in mine[c : c + _SEED_CHUNK]]
                seeds: list[Any] = [None] * len(batches)
                if self.transform is not None:  # the RNG seeds of a chunk of batches, at once
                    seeds = _batch_seeds(
                        self.seed, epoch, [int(p[0]) if p.size else 0 for p in batches]
                    )
                for pos, rng_seed in zip(batches, seeds, strict=True):
                    samples = self._read(epoch, pos, rng_seed)
                    # empty only when on_corrupt="skip" dropped every sample: nothing to collate
                    yield samples if collate_fn is None or not samples else collate_fn(samples)
        finally:
            if self._cache is not None:
                self._cache.park()  # this process reads no further: it holds no shard back

    def set_epoch(self, epoch: int) -> None:
        """Epoch used by plain iteration (``iter(ds)``); the loader tracks its own."""
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0")
        self._epoch = int(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for batch in self.iter_batches(self._epoch, 0, 1, worker_id=wid, num_workers=nw):
            yield batch[0]

    def __len__(self) -> int:
        """Samples this rank yields in one plain epoch (padded so ranks stay equal)."""
        return self.partition(0, 1).num_batches()

    def __repr__(self) -> str:
        roots = ", ".join(s.root for s in self.sources)
        return (
            f"StreamingDataset([{roots}], kind={self.kind}, samples/epoch={self.epoch_length}, "
            f"seed={self.seed}, rank={self.rank}/{self.world_size})"
        )


class _SharedCount:
    """A counter the DataLoader workers add to and the training process reads.

    Shared memory without a lock (a lock belongs to one multiprocessing context, and the
    DataLoader may start its workers with another): one slot per worker id, each written by
    one process only, summed on read. It reaches the workers by inheritance (fork) or with
    the worker's start (spawn, forkserver); pickled any other way (e.g. ``copy.deepcopy``)
    the copy counts on its own.
    """

    _SLOTS = 64

    def __init__(self) -> None:
        self._v: Any = mp.RawArray("q", self._SLOTS)
        self._local = 0

    def add(self, n: int) -> None:
        if self._v is None:
            self._local += n
            return
        info = get_worker_info()
        slot = 0 if info is None else 1 + info.id % (self._SLOTS - 1)
        self._v[slot] += n

    @property
    def value(self) -> int:
        return self._local if self._v is None else int(sum(self._v))

    def __getstate__(self) -> dict[str, Any]:
        spawning = mp_context.get_spawning_popen() is not None
        return {"_v": self._v if spawning else None, "_local": self.value}


def _describe(sample: Any) -> str:
    if isinstance(sample, dict) and "__key__" in sample:
        return f"sample {sample['__key__']!r}"
    return f"a {type(sample).__name__} sample"
