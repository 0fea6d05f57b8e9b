"""How the samples of one source are read: a tar or token dataset, from its local directory or
through the node cache of a remote one.

A reader knows its source's shards (samples per shard, fingerprint) and reads the samples of
one shard at a time, keeping a few shards open (every shard one shuffle window touches, so
nothing is reopened inside a window). With ``verify`` each sample is checked on read, and a
damaged one raises (``on_corrupt="raise"``) or comes back as None (``"skip"``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
import xxhash

from unbroken.common.fs import is_remote, local_path
from unbroken.data.manifest import DatasetManifest, open_regular
from unbroken.data.stream.config import DatasetConfig
from unbroken.data.stream.remote import RemoteCache, load_remote_manifest
from unbroken.data.tar.reader import (
    ShardError,
    ShardReader,
    cached_fix,
    index_format,
    warn_unverified,
)
from unbroken.data.tokens.flat import flat_manifest
from unbroken.data.tokens.shard import TokenShard, num_sequences

__all__ = ["Reader", "open_reader", "read_ids"]

log = logging.getLogger(__name__)

T = TypeVar("T")
MIN_OPEN = 8  # open shards kept per worker and source, at least


class Reader:
    """Sample access for one source: per-shard counts, fingerprint, reads shard by shard."""

    counts: np.ndarray
    fingerprint: str
    fingerprint_v1: str  # as dataset.json version 1 defined it: named when a state carries it

    def __init__(self, root: str, manifest: DatasetManifest, config: DatasetConfig) -> None:
        self.root = root
        self.manifest = manifest
        self.verify = config.verify
        self.on_corrupt = config.on_corrupt
        self.max_open = MIN_OPEN
        self._open: OrderedDict[int, Any] = OrderedDict()
        self._cache: tuple[RemoteCache, int] | None = None  # (cache, this source's index)

    def _set_counts(self, counts: list[int]) -> None:
        self.counts = np.array(counts, dtype=np.int64)
        self._starts = np.zeros(self.counts.size + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self._starts[1:])

    def use_cache(self, cache: RemoteCache, index: int) -> None:
        """Read this (remote) source's shards from ``cache``, as its source ``index``."""
        self.root = cache.local_root(index)
        self._cache = (cache, index)
        cache.attach(index, self)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample ids (manifest order) -> (shard, index in shard)."""
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        return shard, ids - self._starts[shard]

    def _path(self, shard: int) -> str:
        return os.path.join(self.root, self.manifest.shards[shard].name)

    def _shard(self, shard: int) -> Any:
        r = self._open.get(shard)
        if r is None:
            if self._cache is None:
                r = self._open_shard(shard)
            else:
                cache, index = self._cache
                r = cache.open(index, shard, lambda: self._open_shard(shard))
            self._open[shard] = r
            if len(self._open) > self.max_open:
                _, old = self._open.popitem(last=False)
                old.close()
        else:
            self._open.move_to_end(shard)
        return r

    def open_shards(self) -> list[int]:
        return list(self._open)

    def close_shards(self, shards: Iterable[int]) -> None:
        for sh in shards:
            r = self._open.pop(sh, None)
            if r is not None:
                with contextlib.suppress(Exception):  # one that fails to close is gone anyway
                    r.close()

    def _open_shard(self, shard: int) -> Any:
        raise NotImplementedError

    def read(self, shard: int, local: np.ndarray) -> list[Any]:
        raise NotImplementedError

    def read_at(self, shard: int, starts: np.ndarray) -> list[Any]:
        raise NotImplementedError

    def locate_slots(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    @property
    def room(self) -> int:
        """Random windows: how many window starts the source offers (0: none, a tar)."""
        return 0

    def warn_if_unverified(self) -> None:
        """One WARNING per dataset, in this process (workers inherit it), when its indexes
        predate checksums: peeks at the first shard's index magic (8 bytes)."""
        if not self.verify or not self.manifest.shards:
            return
        path = os.path.join(self.root, self.manifest.shards[0].index)
        try:
            with os.fdopen(open_regular(path), "rb") as f:
                magic = f.read(8)
        except OSError:
            return  # not there (yet), or no regular file: opening the shard reports it
        if index_format(magic) == 1:
            warn_unverified(self.root, path)

    def _fix(self, shard: int) -> str:
        """What to do about a shard that is damaged or does not match dataset.json."""
        if self._cache is not None:
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
                cached=self._cache is not None,
            )
        except OSError as e:
            raise ShardError(
                f"dataset {self.root}: shard {info.name} cannot be opened ({e}); {self._fix(shard)}"
            ) from None

    def _check_count(self, shard: int, what: str, recorded: int | None, found: int) -> None:
        """dataset.json's count of ``what`` in ``shard`` must be the shard's own: the order
        deals out the recorded counts, and one the shard does not hold would be read past
        its end (checked with or without ``verify``: a count is no checksum, and it is free)."""
        if recorded is not None and recorded != found:
            info = self.manifest.shards[shard]
            raise ShardError(
                f"dataset {self.root}: shard {info.name}: dataset.json records {recorded} "
                f"{what}, the shard and its index {info.index} hold {found}; dataset.json does "
                f"not describe these files - {self._fix(shard)}"
            )

    def __getstate__(self) -> dict[str, Any]:
        # Open files are per process; a worker started by spawn/forkserver reopens lazily.
        return {**self.__dict__, "_open": OrderedDict()}


class _TarReader(Reader):
    def __init__(
        self, root: str, manifest: DatasetManifest, config: DatasetConfig, seq_len: int | None
    ) -> None:
        super().__init__(root, manifest, config)
        if seq_len is not None:
            raise ValueError(
                f"{root}: seq_len={seq_len} applies to token datasets only; this is a tar "
                "dataset - drop seq_len"
            )
        self._set_counts([s.samples for s in manifest.shards])
        self.fingerprint = manifest.fingerprint
        self.fingerprint_v1 = manifest.fingerprint_v1

    def _open_shard(self, shard: int) -> ShardReader:
        info = self.manifest.shards[shard]
        r = self._open_with(ShardReader, shard)
        try:
            self._check_count(shard, "samples", int(self.counts[shard]), r.index.num_samples)
        except ShardError:
            r.close()
            raise
        if self.verify and (r.index.tar_bytes, r.index.tar_checksum) != (info.bytes, info.checksum):
            r.close()
            raise ShardError(
                f"dataset {self.root}: shard {info.name}: its index describes a tar of "
                f"{r.index.tar_bytes} bytes with checksum {r.index.tar_checksum}, dataset.json "
                f"one of {info.bytes} bytes with checksum {info.checksum}; {self._fix(shard)}"
            )
        return r

    def read(self, shard: int, local: np.ndarray) -> list[Any]:
        reader: ShardReader = self._shard(shard)
        return reader.read_many(local, skip=self.on_corrupt == "skip")


class _TokenReader(Reader):
    def __init__(
        self, root: str, manifest: DatasetManifest, config: DatasetConfig, seq_len: int | None
    ) -> None:
        super().__init__(root, manifest, config)
        m = manifest
        seq_len = seq_len or m.seq_len
        if seq_len is None:
            raise ValueError(
                f"{root}: token dataset without a seq_len (tokenized unpacked); pass "
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
        # made on first read, once a shard has shown windows this long exist (a seq_len in
        # dataset.json is not trusted with an allocation)
        self._span: np.ndarray | None = None
        # Random windows: shard s has max(0, tokens - seq_len) starts whose window fits in it.
        sizes = (
            [
                s.tokens if s.tokens is not None else TokenShard(self._path(i)).num_tokens
                for i, s in enumerate(m.shards)
            ]
            if config.windows == "random"
            else [0] * len(m.shards)
        )
        self.rooms = np.maximum(np.asarray(sizes, dtype=np.int64) - self.seq_len, 0)
        self._room_starts = np.concatenate([[0], np.cumsum(self.rooms)]).astype(np.int64)

    @property
    def room(self) -> int:
        """Random windows: the starts a window can take over all shards (the draw's range)."""
        return int(self._room_starts[-1])

    def locate_slots(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Random-window slots -> (shard, token start in that shard)."""
        shard = np.searchsorted(self._room_starts, slots, side="right") - 1
        return shard, slots - self._room_starts[shard]

    def _open_shard(self, shard: int) -> TokenShard:
        info, m = self.manifest.shards[shard], self.manifest
        ts = self._open_with(TokenShard, shard)
        self._check_count(shard, "tokens", info.tokens, ts.num_tokens)
        self._check_count(shard, "documents", info.documents, ts.num_documents)
        found = num_sequences(ts.num_tokens, self.seq_len)
        self._check_count(shard, f"sequences of {self.seq_len}", int(self.counts[shard]), found)
        want = (m.dtype, m.eos_id, info.bytes, info.checksum)
        have = (ts.dtype.name, ts.eos_id, ts.tokens.nbytes, ts.checksum)
        if self.verify and have != want:
            raise ShardError(
                f"dataset {self.root}: shard {info.name}: its index says (dtype, eos_id, bytes, "
                f"checksum) = {have}, dataset.json {want}; {self._fix(shard)}"
            )
        return ts

    def read(self, shard: int, local: np.ndarray) -> list[Any]:
        return self.read_at(shard, local * self.seq_len)

    def read_at(self, shard: int, starts: np.ndarray) -> list[Any]:
        """The windows of ``seq_len + 1`` tokens at token offsets ``starts`` of ``shard``."""
        ts = self._shard(shard)
        bad = ts.damaged(starts, self.seq_len + 1)  # None unless a block under them is damaged
        if bad is not None and self.on_corrupt == "raise":
            raise ts.error(int(starts[np.flatnonzero(bad)[0]]), self.seq_len + 1)
        if self._span is None:
            self._span = np.arange(self.seq_len + 1, dtype=np.int64)
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


def open_reader(root: str, seq_len: int | None, config: DatasetConfig) -> Reader:
    """The reader of the source at ``root`` (a local directory or a URL; ``seq_len``: its own,
    else the dataset's). A remote one reads from its URL until :meth:`Reader.use_cache`."""
    if is_remote(root):
        manifest = load_remote_manifest(root, config.cache)
        if manifest.kind == "tokens" and any(s.tokens is None for s in manifest.shards):
            raise ValueError(
                f"{root}: the manifest lacks per-shard token counts (an old `unbroken "
                "tokenize`); re-tokenize, or stage it with `unbroken data stage` and read it locally"
            )
    elif os.path.isfile(local_path(root)):  # a flat token file, read in place
        path = local_path(root)
        manifest = flat_manifest(path)
        root = os.path.dirname(os.path.abspath(path))
    else:
        root = local_path(root)
        manifest = DatasetManifest.load(root)
    if manifest.kind == "tar":
        return _TarReader(root, manifest, config, seq_len)  # (the dataset's seq_len: tokens only)
    return _TokenReader(root, manifest, config, seq_len or config.seq_len)


def read_ids(reader: Reader, ids: np.ndarray, *, slots: bool = False) -> list[Any]:
    """Samples ``ids`` (manifest order) of one source, in the order given; read shard by
    shard, each shard's samples in index order (sequential inside a shard, D-IO). Sorting
    the ids once sorts by (shard, index): a shard is a contiguous run of ids.
    ``slots``: the ids are random-window slots (:meth:`Reader.locate_slots`)."""
    n = len(ids)
    if n == 0:
        return []
    order = np.argsort(ids, kind="stable")
    locate, read = (reader.locate_slots, reader.read_at) if slots else (reader.locate, reader.read)
    shard, local = locate(ids[order])
    if shard[0] == shard[-1]:
        got = read(int(shard[0]), local)
    else:
        cuts = (np.flatnonzero(shard[1:] != shard[:-1]) + 1).tolist()
        got = []
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):
            got += read(int(shard[a]), local[a:b])
    out: list[Any] = [None] * n
    for dst, smp in zip(order.tolist(), got, strict=True):
        out[dst] = smp
    return out
