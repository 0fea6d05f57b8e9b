"""The data-preparation commands of ``unbroken`` (pack, index, tokenize, stage).

Split out of :mod:`unbroken.cli` to keep each module to one screenful of concerns; like the
rest of the CLI it only parses, calls the library and prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["add_dataprep"]


# --- lifeline 1a: data preparation (pack, index, tokenize, stage) ---------------------------


def _size(text: str) -> int:
    """``"256MB"`` -> 256_000_000, ``"1GiB"`` -> 1_073_741_824, ``"4096"`` -> 4096."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        n = int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError, OverflowError):  # OverflowError: "1e400" is inf
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 256MB or 1GiB") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive, like 256MB")
    return n


def _at_least(lo: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` that is >= ``lo``."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not v >= lo:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {lo}")
        return v

    return parse


def add_dataprep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pack",
        help="pack small files / JSONL into WebDataset tar shards + index + dataset.json",
        description="Group files by <key>.<ext> (as WebDataset does), or take each JSONL line "
        "as one sample, and write shard-NNNNNN.tar + .idx + dataset.json. Output is identical "
        "for any --workers; re-running after an interruption resumes.",
    )
    p.add_argument("src", help="input directory tree or .jsonl file")
    p.add_argument("out", help="output directory")
    p.add_argument("--shard-size", type=_size, default=256 << 20, help="target tar size (256MiB)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")
    p.add_argument("--allow-partial", action="store_true",
                   help="allow samples that lack members other samples have")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (faster, not durable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip (and count) malformed JSONL lines, unreadable files, symlink "
                   "loops and non-UTF-8 names instead of stopping at the first")
    p.set_defaults(func=_pack)

    p = sub.add_parser("index", help="index existing (e.g. webdataset) tar shards in place",
                       description="Write <shard>.tar.idx for every *.tar in DIR and a "
                       "dataset.json; the tar files are not modified.")
    p.add_argument("dir", help="directory of .tar shards")
    p.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")
    p.set_defaults(func=_index)

    p = sub.add_parser(
        "tokenize",
        help="text (JSONL field, .txt files, tar shards) -> memory-mappable token shards",
        description="Tokenize with a local HF tokenizer.json (or train a BPE one) into "
        "tokens-NNNNNN.bin (uint16/uint32) + document index, EOS after each document. "
        "Output is identical for any --workers; re-running resumes.",
    )
    p.add_argument("src", help=".jsonl / .txt file, a directory of them, or a packed tar dataset")
    p.add_argument("out", help="output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json path")
    p.add_argument("--train-bpe", type=int, default=None, metavar="VOCAB",
                   help="train a byte-level BPE of VOCAB tokens on SRC, saved as --tokenizer "
                   "(default OUT/tokenizer.json); an existing file there is reused")
    p.add_argument("--field", default="text", help="JSON field holding the text (default: text)")
    p.add_argument("--member", default="txt", help="tar member holding the text (default: txt)")
    p.add_argument("--seq-len", type=int, default=None, help="pack into sequences of this length")
    p.add_argument("--shard-size", type=_size, default=256 << 20, help="max token bytes/shard")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                   help="token dtype (default: uint16 if the vocabulary fits)")
    p.add_argument("--eos-token", default=None, help="end-of-document token (default: detect)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (faster, not durable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_tokenize)

    p = sub.add_parser(
        "stage",
        help="copy a dataset from any fsspec URL to local disk, verified",
        description="Copy dataset.json + shards + indexes from URL (s3://, file://, a mount) "
        "into LOCAL_DIR in parallel, verifying checksums; valid files are skipped.",
    )
    p.add_argument("url", help="dataset root: local path or fsspec URL")
    p.add_argument("local_dir", help="local destination directory")
    p.add_argument("--workers", type=int, default=8, help="parallel transfers (default: 8)")
    p.add_argument("--ranks-local", action="store_true",
                   help="only LOCAL_RANK 0 copies; other local ranks wait for its marker")
    p.add_argument("--wait-timeout", type=_at_least(0, float), default=3600.0,
                   help="seconds non-zero local ranks wait (default: 3600)")
    p.add_argument("--retries", type=_at_least(0), default=1,
                   help="re-fetches on checksum mismatch")
    p.add_argument("--fsync", action="store_true", help="fsync every staged file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_stage)


def _pack(a: argparse.Namespace) -> int:
    from unbroken.data.pack import pack

    r = pack(a.src, a.out, shard_size=a.shard_size, workers=a.workers,
             allow_partial=a.allow_partial, fsync=not a.no_fsync, progress=not a.no_progress,
             skip_bad=a.skip_bad)
    m = r.manifest
    skipped = f"; {r.skipped} bad inputs skipped" if a.skip_bad else ""
    print(f"{m.num_samples} samples in {len(m.shards)} shards ({r.shards_written} written, "
          f"{r.shards_reused} reused), {r.bytes / 1e6:.1f} MB in {r.seconds:.2f}s "
          f"({r.mb_per_s:.1f} MB/s); fingerprint {m.fingerprint}{skipped}")
    return 0


def _index(a: argparse.Namespace) -> int:
    from unbroken.data.pack import index_directory

    r = index_directory(a.dir, workers=a.workers)
    m = r.manifest
    print(f"indexed {len(m.shards)} shards, {m.num_samples} samples in {r.seconds:.2f}s; "
          f"fingerprint {m.fingerprint}")
    return 0


def _tokenize(a: argparse.Namespace) -> int:
    from unbroken.data.tokenizing import tokenize

    r = tokenize(a.src, a.out, tokenizer=a.tokenizer, train_bpe_vocab=a.train_bpe,
                 field=a.field, member=a.member, seq_len=a.seq_len, shard_size=a.shard_size,
                 dtype=a.dtype, eos_token=a.eos_token, workers=a.workers,
                 fsync=not a.no_fsync, progress=not a.no_progress)
    m = r.manifest
    print(f"{r.documents} documents, {r.tokens} tokens ({m.dtype}) in {len(m.shards)} shards, "
          f"{m.num_samples} samples, {r.seconds:.2f}s ({r.tokens_per_s:,.0f} tokens/s); "
          f"fingerprint {m.fingerprint}")
    return 0


def _stage(a: argparse.Namespace) -> int:
    from unbroken.data.stage import stage

    r = stage(a.url, a.local_dir, workers=a.workers, fsync=a.fsync, ranks_local=a.ranks_local,
              wait_timeout=a.wait_timeout, retries=a.retries, progress=not a.no_progress)
    print(r)
    return 0
