"""`StreamingDataset`: an IterableDataset over packed tar shards or token shards.

What a rank sees is fixed by the epoch order (:mod:`unbroken.data.stream.order`, D-ORDER)
and by the partition of one run (:class:`~unbroken.data.stream.order.Partition`): the
batches a rank receives do not depend on ``num_workers`` or ``prefetch_factor``. A worker
reads only the samples of its own batches, each batch from one shuffle window (D-IO,
D-SHUFFLE).

Samples: a tar dataset yields ``{"__key__": str, "<ext>": bytes, ...}``; a token dataset
``np.int64`` arrays of ``seq_len + 1`` tokens. ``transform`` runs in the worker with its
RNGs seeded from (seed, epoch, position), so augmentations resume exactly.
``with_ids=True`` adds each sample's id (``"__id__"``, or a ``(sample, id)`` pair); several
sources mix by weight (:class:`Source`); a flat token file (``train.bin``) is a source
too, and ``windows="random"`` draws nanoGPT-style random windows from the position.

Every sample byte is verified on read (``verify=True``, T-NO-WRONG-BYTE): damage raises
:class:`~unbroken.data.tar.reader.CorruptSampleError` naming dataset, shard and sample, or
with ``on_corrupt="skip"`` leaves the sample out and counts it (:attr:`corrupt_skipped`).

Use it through :class:`unbroken.data.stream.loader.StatefulLoader` (batching, workers, the
resume state). How ranks, workers, ids, mixtures, verification and random windows work:
ARCHITECTURE.md, "Design notes" > data > the dataset.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import random
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import context as mp_context
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from unbroken.common.config import configure
from unbroken.common.fs import is_remote, path_str
from unbroken.data.stream.config import ON_CORRUPT, DatasetConfig
from unbroken.data.stream.order import (
    DatasetOrder,
    Partition,
    mix_seed,
    mix_seeds,
    random_slots,
    shards_per_window,
)
from unbroken.data.stream.readers import MIN_OPEN, Reader, open_reader, read_ids
from unbroken.data.stream.remote import (
    RemoteSource,
    check_cache_config,
    fit_cache,
    open_cache,
)

__all__ = ["ON_CORRUPT", "Source", "StreamingDataset"]

log = logging.getLogger(__name__)

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
        whose shards are read through the node's bounded cache (the dataset config's
        ``cache``: a :class:`~unbroken.data.CacheConfig`, which also holds the store's
        ``storage_options``; see :mod:`unbroken.data.stream.remote`).
    weight: relative share of the mixture's positions (any positive scale; normalised).
    seq_len: token datasets only: tokens per sequence (a sample is ``seq_len + 1`` tokens);
        default: the dataset config's ``seq_len``, else the one it was tokenized with.
    """

    root: str
    weight: float = 1.0
    seq_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", path_str(self.root))  # a pathlib.Path too
        if not isinstance(self.root, str) or not self.root:
            raise ValueError(f"Source root={self.root!r} must be a non-empty path string")
        if not self.weight > 0:
            raise ValueError(f"Source {self.root}: weight={self.weight} must be > 0")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"Source {self.root}: seq_len={self.seq_len} must be >= 1")


def _check_random(srcs: list[Source], readers: list[Reader]) -> None:
    """``windows="random"`` needs local token datasets with room for one window."""
    for s, r in zip(srcs, readers, strict=True):
        if r.manifest.kind != "tokens":
            raise ValueError(
                f"{s.root}: windows='random' applies to token datasets (a random token "
                "offset); this is a tar dataset - drop windows, or set shuffle"
            )
        if is_remote(s.root):
            raise ValueError(
                f"{s.root}: windows='random' reads anywhere in the dataset, which a remote "
                "source cannot serve (D-IO); stage it first (`unbroken data stage`) or use "
                "windows='fixed', which shuffles in local windows"
            )
        if r.room < 1:
            raise ValueError(
                f"{s.root}: no shard holds more than seq_len tokens, so no random window of "
                "seq_len + 1 tokens fits; use a smaller seq_len"
            )


def _resolve_rank(config: DatasetConfig) -> tuple[int, int]:
    """(rank, world size): the config's, else torch.distributed's, else (0, 1)."""
    if config.rank is not None and config.world_size is not None:
        return config.rank, config.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _as_sources(sources: Any) -> list[Source]:
    if isinstance(sources, (str, Source, os.PathLike)):
        sources = [sources]
    srcs = [s if isinstance(s, Source) else Source(s) for s in sources]
    if not srcs:
        raise ValueError("sources is empty; pass a dataset directory or a list of Source")
    return srcs


class StreamingDataset(IterableDataset):
    """Deterministic, resumable stream over one or several packed datasets (module docstring).

    ``StreamingDataset(sources, config=None, *, transform=None, **overrides)``:

    * ``sources``: a dataset directory or URL, a :class:`Source`, or a list of them to mix
      by weight;
    * ``config``: a :class:`~unbroken.data.DatasetConfig` (what each option does, its unit
      and default: seed, shuffle, shuffle_window, seq_len, rank/world_size, with_ids,
      verify, on_corrupt, mixture settings, and ``cache``, a
      :class:`~unbroken.data.CacheConfig` for remote sources); the keywords are fields of
      it, applied over ``config`` (``StreamingDataset(d, seed=1, seq_len=1024)``);
    * ``transform``: a per-sample function run in the worker (decode, augment; picklable);
      the global CPU RNGs it draws from are seeded per batch (see the module docstring).
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Source | Sequence[str | os.PathLike[str] | Source],
        config: DatasetConfig | None = None,
        *,
        transform: Callable[[Any], Any] | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        c = self.config = configure(DatasetConfig, config, overrides, owner="StreamingDataset")
        srcs = _as_sources(sources)
        self.sources = tuple(srcs)
        self.transform = transform
        self.rank, self.world_size = _resolve_rank(c)
        check_cache_config([s.root for s in srcs], c.cache)  # before any download
        self._readers = [open_reader(s.root, s.seq_len, c) for s in srcs]
        for s, r in zip(srcs, self._readers, strict=True):
            r.warn_if_unverified()
            if int(r.counts.sum()) == 0:
                raise ValueError(f"{s.root}: the dataset holds no samples")
        self._skipped = _SharedCount() if c.on_corrupt == "skip" else None
        self.kind = self._readers[0].manifest.kind
        self._random = c.windows == "random"
        if self._random:
            _check_random(srcs, self._readers)

        def order_for(window: int | None) -> DatasetOrder:
            return DatasetOrder(
                [r.counts for r in self._readers],
                [r.fingerprint for r in self._readers],
                seed=c.seed,
                shuffle=c.shuffle,
                shuffle_window=window,
                weights=[s.weight for s in srcs],
                samples_per_epoch=c.samples_per_epoch,
                mix_block=c.mix_block,
            )

        remote = [RemoteSource(i, s.root, self._readers[i].manifest) for i, s in enumerate(srcs)]
        remote = [x for x in remote if is_remote(x.url)]
        # a cache limit too small for the default window / read-ahead: the largest that fit
        window, cache_config = fit_cache(order_for, remote, c, c.cache)
        self.order = order_for(window if window is not None else c.shuffle_window)
        for r, w in zip(self._readers, self.order.windows, strict=True):
            r.max_open = max(MIN_OPEN, shards_per_window(r.counts, w or 1) + 1)
        sizes = [r.room for r in self._readers] if self._random else self.order.sizes
        self._id_base = np.cumsum([0, *sizes[:-1]], dtype=np.int64)  # each source's first id
        self._epoch = 0
        self.cache = open_cache(self.order, remote, cache_config)
        """The node cache of the remote sources (None when every source is local)."""
        if self.cache is not None:
            for x in remote:
                self._readers[x.index].use_cache(self.cache, x.index)

    # --- the order ---------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """The dataset's fingerprint (a single source's, or the mixture's): D-FINGERPRINT."""
        return self.order.fingerprint

    @property
    def epoch_length(self) -> int:
        """Positions per epoch."""
        return self.order.length

    @property
    def shuffle_window(self) -> list[int]:
        """Each source's shuffle window in samples (0: no shuffle)."""
        return list(self.order.windows)

    @property
    def source_fingerprints(self) -> tuple[str, ...]:
        return self.order.fingerprints

    @property
    def source_fingerprints_v1(self) -> tuple[str, ...]:
        """Each source's fingerprint as unbroken computed it before issue 20 (dataset.json
        version 1, not covering the indexes): a resume state saved then carries it."""
        return tuple(r.fingerprint_v1 for r in self._readers)

    @property
    def weights(self) -> tuple[float, ...]:
        return self.order.weights

    def lookup(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Epoch positions -> (source index, sample id in that source's manifest order)."""
        return self.order.lookup(epoch, positions)

    @property
    def corrupt_skipped(self) -> int:
        """Damaged samples left out so far (``on_corrupt="skip"``), summed over the workers."""
        return 0 if self._skipped is None else self._skipped.value

    def read(self, epoch: int, positions: np.ndarray) -> list[Any]:
        """The samples at ``positions`` of ``epoch``, in that order, transformed (with
        ``on_corrupt="skip"``, without the damaged ones)."""
        return self._read(epoch, positions, None)

    def _read(self, epoch: int, positions: np.ndarray, rng_seed: int | None) -> list[Any]:
        if self.cache is not None:
            self.cache.advance(epoch, positions)  # prefetch from here; release what is done
        src, ids = self._locate(epoch, positions)
        if src is None:
            out = read_ids(self._readers[0], ids, slots=self._random)
            gid = ids
        else:
            out = [None] * len(ids)
            for i in np.unique(src).tolist():
                sel = np.flatnonzero(src == i)
                got = read_ids(self._readers[i], ids[sel], slots=self._random)
                for dst, smp in zip(sel.tolist(), got, strict=True):
                    out[dst] = smp
            gid = self._id_base[src] + ids
        kept = positions  # positions of the samples in `out`
        with_ids = self.config.with_ids
        gids = gid.tolist() if with_ids else []
        if self._skipped is not None and any(smp is None for smp in out):
            keep = [k for k, smp in enumerate(out) if smp is not None]
            self._skipped.add(len(out) - len(keep))
            kept, out = np.asarray(positions)[keep], [out[k] for k in keep]
            gids = [gids[k] for k in keep] if with_ids else []
        if self.transform is not None and len(out):
            fn = self.transform
            with _seeded_rngs(self.config.seed, epoch, int(positions[0]), rng_seed):
                for k, smp in enumerate(out):
                    try:
                        out[k] = fn(smp)
                    except Exception as e:
                        raise RuntimeError(
                            f"transform {getattr(fn, '__name__', fn)!r} failed on "
                            f"{_describe(smp)} (epoch {epoch}, position {int(kept[k])}): "
                            f"{e!r}"
                        ) from e
        if with_ids:
            for k, smp in enumerate(out):
                if isinstance(smp, dict):
                    smp["__id__"] = gids[k]
                else:
                    out[k] = (smp, gids[k])
        return out

    def sample_ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The ids ``with_ids=True`` hands out for ``positions`` of ``epoch``, without reading
        a sample (a pure function of the order: D-ORDER)."""
        src, ids = self._locate(epoch, positions)
        return ids if src is None else self._id_base[src] + ids

    def _locate(self, epoch: int, positions: np.ndarray) -> tuple[Any, np.ndarray]:
        """(source per position, or None for one source; id or window slot in that source)."""
        if self._random:
            return self._random_slots(epoch, positions)
        if len(self._readers) == 1:  # (lookup's per-source split, without its numpy calls)
            return None, self.order.pass_order(0, epoch).ids(np.asarray(positions, np.int64))
        return self.lookup(epoch, positions)

    def _random_slots(self, epoch: int, positions: np.ndarray) -> tuple[Any, np.ndarray]:
        """Random windows: (source per position, or None for one source; window slot)."""
        pos = np.asarray(positions, dtype=np.int64)
        fp, seed = self.fingerprint, self.config.seed
        if len(self._readers) == 1:
            return None, random_slots(fp, seed, epoch, pos, self._readers[0].room)
        src, _ = self.lookup(epoch, pos)  # the mixture's choice of source, then its window
        rooms = np.asarray([r.room for r in self._readers], dtype=np.int64)
        return src, random_slots(fp, seed, epoch, pos, rooms[src])

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
    ) -> Generator[Any, None, None]:
        """Batches ``first + worker_id, first + worker_id + num_workers, ...`` of this rank's
        run (``first``: batches made elsewhere, e.g. by the loader before its workers start)."""
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
                        self.config.seed, epoch, [int(p[0]) if p.size else 0 for p in batches]
                    )
                for pos, rng_seed in zip(batches, seeds, strict=True):
                    samples = self._read(epoch, pos, rng_seed)
                    # empty only when on_corrupt="skip" dropped every sample: nothing to collate
                    yield samples if collate_fn is None or not samples else collate_fn(samples)
        finally:
            if self.cache is not None:
                self.cache.park()  # this process reads no further: it holds no shard back

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
            f"seed={self.config.seed}, rank={self.rank}/{self.world_size})"
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
