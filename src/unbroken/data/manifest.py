"""`dataset.json`: the manifest of a packed (tar) or tokenized (tokens) dataset.

Written atomically, last, so a dataset is visible only when complete. It lists the
shards (name, samples, bytes, checksums of the shard and of its index) and, for tokens,
``dtype``, ``eos_id``, ``seq_len`` and ``vocab_size``; a tokens *sample* is one sequence
of ``seq_len + 1`` tokens when ``seq_len`` is set, else one document.

``dataset.json`` is the one root of trust of a dataset (T-NO-WRONG-BYTE): its fingerprint
(:func:`fingerprint`) covers every field but ``extra``, so anything that changes what a
sample is changes the fingerprint and a saved loader state is refused (D-FINGERPRINT).
Version 1 is still read (its fingerprint is checked by the old formula, then
recomputed). A manifest larger than :data:`MAX_MANIFEST_BYTES` is refused unread
(T-BOUNDED).

The format on disk and the version-1 upgrade: ARCHITECTURE.md, "Design notes" > data >
dataset.json.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import fsspec

from unbroken.common.fs import (
    atomic_write_bytes,
    hasher,
    is_remote,
    is_temp_name,
    local_path,
    path_str,
)
from unbroken.common.text import printable

__all__ = [
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MAX_VOCAB",
    "DatasetManifest",
    "ManifestError",
    "ShardInfo",
    "fingerprint",
    "join_path",
    "open_regular",
    "read_bounded",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "dataset.json"


def manifest_bytes(store: Any) -> bytes:
    """The bytes of ``dataset.json`` at the root of an object ``store``, unparsed: one GET
    of at most :data:`MAX_MANIFEST_BYTES` + 1 bytes (a larger one is refused unread)."""
    from unbroken.common.errors import ObjectMismatch

    try:
        return bytes(store.get_bytes(MANIFEST_NAME, max_bytes=MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        raise no_manifest(store.url_of(MANIFEST_NAME)) from None
    except ObjectMismatch as e:
        raise ManifestError(f"{e}; re-create the manifest") from None


def no_manifest(path: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{path}: no dataset manifest; create one with `unbroken data pack`, "
        "`unbroken data index` or `unbroken data tokenize`"
    )


MAX_MANIFEST_BYTES = 256 << 20
"""dataset.json files larger than this (about 900,000 shards) are refused without parsing."""
_FORMAT = "unbroken-dataset"
_VERSION = 2
_READS = (1, 2)  # version 1: the fingerprint did not cover the indexes (see the module doc)
_HEX128 = re.compile(r"[0-9a-f]{32}")
_KINDS = ("tar", "tokens")
_DTYPES = ("uint16", "uint32")
_NAME_MAX = 255  # bytes of a file name (Linux NAME_MAX): a longer one is no file
_COUNT = (0, 2**63 - 1)  # sizes and counts: what an int64 holds (numpy indexes with them)
MAX_VOCAB = 1 << 32
"""The largest vocabulary a token file holds: its ids are uint16 or uint32."""
_TOKEN_ID = (-1, MAX_VOCAB - 1)  # eos_id: a uint32 id, or -1 (a flat file: no document ends)


def _int(d: dict[str, Any], key: str, lo: int, hi: int, where: str = "") -> int:
    """``d[key]`` as an int in ``[lo, hi]``: a JSON integer, nothing else (a float, a bool,
    a string or a non-finite number is not converted), so every count fits an int64."""
    v = d[key]
    if type(v) is not int or not lo <= v <= hi:
        shown = printable(repr(v))
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        raise ManifestError(f"{where}{key}={shown} is not an integer in [{lo}, {hi}]")
    return v


def _opt_int(d: dict[str, Any], key: str, lo: int, hi: int, where: str = "") -> int | None:
    return None if d.get(key) is None else _int(d, key, lo, hi, where)


def read_bounded(f: Any, limit: int, chunk: int = 4 << 20) -> bytes:
    """At most ``limit`` bytes of a binary file object, in chunks (``f.read(limit)`` would
    allocate ``limit`` bytes up front, whatever the file holds)."""
    buf = bytearray()
    while len(buf) < limit:
        data = f.read(min(chunk, limit - len(buf)))
        if not data:
            break
        buf += data
    return bytes(buf)


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file: opened without
    blocking (a FIFO planted there would block ``open`` until a writer came) and refused when
    it is a FIFO, a device (``/dev/zero`` reads without end) or a directory (T-BOUNDED)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or directory)", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ManifestError(ValueError):
    """A dataset.json that is missing, malformed, of an unknown version or inconsistent."""


def join_path(root: str, name: str) -> str:
    """Join a file name onto a local dir or an fsspec URL, keeping ``s3://`` intact."""
    if "://" in root:
        return root.rstrip("/") + "/" + name
    return os.path.join(root, name)


@dataclass(frozen=True)
class ShardInfo:
    """One shard file and its index file, with sizes and xxh3-128 checksums.

    ``index`` is the index file name (tar: the ``.idx`` offset index; tokens: the document
    offset index), relative to the dataset root like ``name``.
    """

    name: str
    samples: int
    bytes: int
    checksum: str
    index: str
    index_bytes: int
    index_checksum: str
    documents: int | None = None
    """tokens only: documents in this shard (``samples`` counts sequences when packed)."""
    tokens: int | None = None
    """tokens only: tokens in this shard, EOS separators included."""

    def __post_init__(self) -> None:
        for fname in ("name", "index"):
            v = getattr(self, fname)
            if len(v.encode("utf-8", "surrogatepass")) > _NAME_MAX:
                raise ManifestError(
                    f"shard {fname} of {len(v):,} characters ({printable(v[:40])}...) is longer "
                    f"than a file name can be ({_NAME_MAX} bytes)"
                )
            # no control characters: names reach messages and terminals (issue 20 item 11)
            if not v or "/" in v or v in (".", "..") or printable(v) != v:
                raise ManifestError(
                    f"shard {fname}={printable(v)!r} must be a plain file name (no '/', no "
                    "control characters)"
                )
        if self.samples < 0 or self.bytes < 0 or self.index_bytes < 0:
            raise ManifestError(f"shard {self.name}: negative size or sample count")
        if (self.documents or 0) < 0 or (self.tokens or 0) < 0:
            raise ManifestError(f"shard {self.name}: negative documents or tokens")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardInfo:
        if not isinstance(d, dict):
            raise ManifestError(f"a shard record is {type(d).__name__}, not an object")
        where = f"shard {printable(d.get('name'))[:80]!r}: "
        for fname in ("checksum", "index_checksum"):
            v = d[fname]
            if not isinstance(v, str) or not _HEX128.fullmatch(v):
                raise ManifestError(
                    f"shard {printable(d.get('name'))!r}: {fname}={printable(v)!r} is not an "
                    "xxh3-128 digest (32 lowercase hex digits)"
                )
        return cls(
            name=str(d["name"]),
            samples=_int(d, "samples", *_COUNT, where),
            bytes=_int(d, "bytes", *_COUNT, where),
            checksum=str(d["checksum"]),
            index=str(d["index"]),
            index_bytes=_int(d, "index_bytes", *_COUNT, where),
            index_checksum=str(d["index_checksum"]),
            documents=_opt_int(d, "documents", *_COUNT, where),
            tokens=_opt_int(d, "tokens", *_COUNT, where),
        )


def fingerprint(
    kind: str,
    shards: tuple[ShardInfo, ...] | list[ShardInfo],
    *,
    seq_len: int | None = None,
    dtype: str | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> str:
    """xxh3-128 over every field of a manifest but ``extra``: kind, the token fields and, per
    shard in order, every field of its record (name, samples, bytes, checksum, index,
    index_bytes, index_checksum, documents, tokens).

    The shard checksum covers every byte of the shard and the index checksum every byte of its
    index (offsets, keys and member checksums), so whatever changes a sample changes the
    fingerprint: dataset.json is the one root (issue 20 item 9).
    """
    h = hasher()
    head = [_FORMAT, _VERSION, kind, seq_len, dtype, eos_id, vocab_size]
    h.update(json.dumps(head).encode() + b"\n")
    for s in shards:
        h.update(json.dumps(s.to_json(), sort_keys=True, separators=(",", ":")).encode() + b"\n")
    return str(h.hexdigest())


def _fingerprint_v1(kind: str, shards: tuple[ShardInfo, ...], seq_len: int | None) -> str:
    """The fingerprint dataset.json version 1 stored (names, sample counts, shard checksums):
    checked when such a file is read, and named when a resume state still carries it."""
    h = hasher()
    h.update(f"{_FORMAT}/1/{kind}/{seq_len}\n".encode())
    for s in shards:
        h.update(f"{s.name}\t{s.samples}\t{s.checksum}\n".encode())
    return str(h.hexdigest())


@dataclass(frozen=True)
class DatasetManifest:
    """The content of ``dataset.json``; build with :meth:`create`, read with :meth:`load`."""

    kind: str
    shards: tuple[ShardInfo, ...]
    fingerprint: str
    num_samples: int
    dtype: str | None = None
    eos_id: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form provenance (tool, options); not part of the fingerprint."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ManifestError(f"kind={self.kind!r} is not one of {_KINDS}")
        # One file per name: staging and the node cache write, verify and evict by name, and
        # remove temporaries by their prefix
        seen: set[str] = set()
        for name in (n for s in self.shards for n in (s.name, s.index)):
            if name in seen or name == MANIFEST_NAME or is_temp_name(name):
                raise ManifestError(
                    f"file name {name!r} is listed twice, or is {MANIFEST_NAME} or a "
                    "temporary's (.tmp-*): every shard and index needs a file of its own"
                )
            seen.add(name)
        if self.num_samples != sum(s.samples for s in self.shards):
            raise ManifestError(
                f"num_samples={self.num_samples} differs from the sum over shards "
                f"({sum(s.samples for s in self.shards)})"
            )
        if self.kind == "tokens":
            if self.dtype not in _DTYPES:
                raise ManifestError(f"tokens dataset: dtype={self.dtype!r} not in {_DTYPES}")
            if self.eos_id is None:
                raise ManifestError("tokens dataset: eos_id is required")
            if self.seq_len is not None and self.seq_len < 1:
                raise ManifestError(f"tokens dataset: seq_len={self.seq_len} must be >= 1")

    @classmethod
    def create(
        cls,
        kind: str,
        shards: list[ShardInfo] | tuple[ShardInfo, ...],
        *,
        dtype: str | None = None,
        eos_id: int | None = None,
        seq_len: int | None = None,
        vocab_size: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> DatasetManifest:
        """Build a manifest, computing ``num_samples`` and the fingerprint."""
        shards = tuple(shards)
        return cls(
            kind=kind,
            shards=shards,
            fingerprint=fingerprint(
                kind, shards, seq_len=seq_len, dtype=dtype, eos_id=eos_id, vocab_size=vocab_size
            ),
            num_samples=sum(s.samples for s in shards),
            dtype=dtype,
            eos_id=eos_id,
            seq_len=seq_len,
            vocab_size=vocab_size,
            extra=dict(extra or {}),
        )

    # --- serialization -------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": _FORMAT,
            "version": _VERSION,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "num_samples": self.num_samples,
            "shards": [s.to_json() for s in self.shards],
        }
        if self.kind == "tokens":
            d.update(
                dtype=self.dtype,
                eos_id=self.eos_id,
                seq_len=self.seq_len,
                vocab_size=self.vocab_size,
            )
        if self.extra:
            d["extra"] = self.extra
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, d: Any, *, source: str = "<dict>") -> DatasetManifest:
        """Parse and validate; every error names ``source`` and the offending field."""
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise ManifestError(
                f"{source}: not an unbroken dataset manifest (missing 'format': {_FORMAT!r}); "
                "create it with `unbroken data pack`, `unbroken data index` or `unbroken data tokenize`"
            )
        version = d.get("version")
        if version not in _READS:
            raise ManifestError(
                f"{source}: manifest version {printable(version)} is not supported (this "
                f"unbroken reads versions {_READS[0]} to {_READS[-1]}); upgrade unbroken or "
                "re-create the dataset"
            )
        try:
            shards = tuple(ShardInfo.from_json(s) for s in d["shards"])
            m = cls(
                kind=str(d["kind"]),
                shards=shards,
                fingerprint=str(d["fingerprint"]),
                num_samples=_int(d, "num_samples", *_COUNT),
                dtype=d.get("dtype"),
                eos_id=_opt_int(d, "eos_id", *_TOKEN_ID),
                seq_len=_opt_int(d, "seq_len", 1, _COUNT[1]),
                vocab_size=_opt_int(d, "vocab_size", 1, MAX_VOCAB),
                extra=dict(d.get("extra") or {}),
            )
        except ManifestError as e:
            raise ManifestError(f"{source}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{source}: malformed manifest field ({e!r})") from None
        want = m._computed_fingerprint()
        stored = m.fingerprint
        if version == 1:
            want, m = m.fingerprint_v1, replace(m, fingerprint=want)
        if want != stored:
            raise ManifestError(
                f"{source}: fingerprint {printable(stored)} does not match its shard list "
                f"({want}); the manifest was edited or damaged - re-create it"
            )
        if version == 1:
            log.info(
                "%s: dataset.json version 1 (its fingerprint did not cover the indexes); "
                "fingerprint recomputed over every field: %s (was %s)",
                source,
                m.fingerprint,
                stored,
            )
        return m

    def _computed_fingerprint(self) -> str:
        return fingerprint(
            self.kind,
            self.shards,
            seq_len=self.seq_len,
            dtype=self.dtype,
            eos_id=self.eos_id,
            vocab_size=self.vocab_size,
        )

    @property
    def fingerprint_v1(self) -> str:
        """What dataset.json version 1 fingerprinted for these shards (before issue 20): a
        resume state saved by that version carries it."""
        return _fingerprint_v1(self.kind, self.shards, self.seq_len)

    @classmethod
    def load(
        cls, root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
    ) -> DatasetManifest:
        """Read ``<root>/dataset.json`` (root: a local dir, an fsspec URL, or the json path;
        ``storage_options`` go to fsspec, e.g. an S3 endpoint and credentials)."""
        root = path_str(root)
        path = root if root.endswith(".json") else join_path(root, MANIFEST_NAME)
        try:
            if is_remote(path):
                with fsspec.open(path, "rb", **(storage_options or {})) as f:
                    raw = read_bounded(f, MAX_MANIFEST_BYTES + 1)
            else:
                with os.fdopen(open_regular(local_path(path)), "rb") as f:
                    raw = read_bounded(f, MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            raise no_manifest(path) from None
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            raise ManifestError(f"{path}: {e.strerror}; re-create the manifest") from None
        return cls.parse(raw, source=path)

    @classmethod
    def from_store(cls, store: Any) -> DatasetManifest:
        """Read ``dataset.json`` at the root of ``store`` (an
        :class:`~unbroken.common.objstore.ObjectStore`) in one bounded GET."""
        return cls.parse(manifest_bytes(store), source=store.url_of(MANIFEST_NAME))

    @classmethod
    def parse(cls, raw: bytes, *, source: str) -> DatasetManifest:
        """The manifest in ``raw`` (the bytes of a dataset.json); errors name ``source``."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{source}: larger than {MAX_MANIFEST_BYTES:,} bytes (MAX_MANIFEST_BYTES); not "
                "a dataset manifest unbroken reads - re-create it"
            )
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{source}: malformed JSON ({e}); re-create the manifest") from None
        except RecursionError:  # json recurses once per level of nesting
            raise ManifestError(
                f"{source}: JSON nested too deeply to be a dataset manifest; re-create it"
            ) from None
        return cls.from_json(d, source=source)

    def save(self, root: str) -> str:
        """Atomically write ``<root>/dataset.json`` (local dir or fsspec URL); returns path."""
        path = join_path(root, MANIFEST_NAME)
        data = self.dumps().encode()
        if is_remote(root):
            # Object stores publish a PUT atomically; no temp+rename needed (or possible).
            with fsspec.open(path, "wb") as f:
                f.write(data)
        else:
            atomic_write_bytes(local_path(path), data)
        return path

    # --- helpers ---------------------------------------------------------------------------

    def shard_path(self, root: str, i: int) -> str:
        return join_path(root, self.shards[i].name)

    def index_path(self, root: str, i: int) -> str:
        return join_path(root, self.shards[i].index)

    @property
    def total_bytes(self) -> int:
        """Bytes of all shard and index files (what staging copies, manifest excluded)."""
        return sum(s.bytes + s.index_bytes for s in self.shards)
