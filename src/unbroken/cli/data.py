"""``unbroken data pack | index | tokenize | stage | inspect | bench | report``: prepare a
dataset, look at its streaming order, and find what starves the GPU."""

from __future__ import annotations

import argparse

from unbroken.cli._args import Sub, add_command, at_least, size
from unbroken.common.text import printable

__all__ = ["PREP_COMMANDS", "add_data"]

PREP_COMMANDS = frozenset({"pack", "index", "tokenize", "stage"})
"""Commands that print their own summary line (the library's INFO line would repeat it)."""

# Defaults below that a library function also has (shard size, stage workers, ...) are
# checked against its signature by tests/unit/test_cli_tree.py: importing the library here
# would cost every `unbroken --help` ~0.4 s.


def _say(text: object) -> None:
    """Print a command's output: what comes from a file (dataset.json, data_bench.json, a
    timeline) shows control characters as visible escapes (issue 20 item 11)."""
    print(printable(text, multiline=True))


# --- prepare: pack, index, tokenize, stage --------------------------------------------------


def _add_pack(ds: Sub) -> None:
    p = add_command(
        ds,
        "pack",
        "pack small files / JSONL into WebDataset tar shards + index + dataset.json",
        "unbroken data pack ./raw-files ./data --shard-size 256MiB",
        "Group files by <key>.<ext> (as WebDataset does), or take each JSONL line as one "
        "sample, and write shard-NNNNNN.tar + .idx + dataset.json. Output is identical for "
        "any --workers; re-running after an interruption resumes.",
        func=_pack,
    )
    p.add_argument("src", help="input directory tree or .jsonl file")
    p.add_argument("out", help="output directory")
    p.add_argument("--shard-size", type=size, default=256 << 20, help="target tar size (256MiB)")
    p.add_argument(
        "--workers", type=at_least(1), default=None, help="processes (default: CPU count)"
    )
    p.add_argument(
        "--allow-partial",
        action="store_true",
        help="allow samples that lack members other samples have",
    )
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (faster, not durable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip (and count) malformed JSONL lines, unreadable files, symlink "
        "loops and non-UTF-8 names instead of stopping at the first",
    )


def _add_index(ds: Sub) -> None:
    p = add_command(
        ds,
        "index",
        "index tar shards or a flat token file (nanoGPT's train.bin) in place",
        "unbroken data index ./webdataset-shards\n  unbroken data index data/train.bin --meta data/meta.pkl",
        "DIR: write <shard>.tar.idx for every *.tar in DIR and a dataset.json. FILE (a flat "
        "uint16/uint32 token file; its width from --meta, --vocab-size or --dtype, one of them "
        "required): write FILE.idx (checksums) and FILE.dataset.json beside it; "
        "StreamingDataset(FILE, seq_len=...) then reads it in place. Nothing is modified or "
        "copied. meta.pkl is read without unpickling code (only its vocab_size).",
        func=_index,
    )
    p.add_argument("dir", help="directory of .tar shards, or a flat token file")
    p.add_argument(
        "--workers", type=at_least(1), default=None, help="processes (default: CPU count)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--vocab-size", type=at_least(1), default=None, help="flat file: vocabulary")
    p.add_argument("--meta", default=None, help="flat file: nanoGPT meta.pkl with vocab_size")
    p.add_argument(
        "--dtype",
        choices=("uint16", "uint32"),
        default=None,
        help="flat file: token dtype (default: from the vocabulary, uint16 up to 65,536 ids)",
    )


def _add_tokenize(ds: Sub) -> None:
    p = add_command(
        ds,
        "tokenize",
        "text (JSONL field, .txt files, tar shards) -> memory-mappable token shards",
        "unbroken data tokenize corpus.jsonl ./tok --train-bpe 8192 --seq-len 1024",
        "Tokenize with a local HF tokenizer.json (or train a BPE one) into "
        "tokens-NNNNNN.bin (uint16/uint32) + document index, EOS after each document. "
        "Output is identical for any --workers; re-running resumes.",
        func=_tokenize,
    )
    p.add_argument(
        "src",
        help=".jsonl / .txt file, a directory of them, a packed tar dataset, or with "
        "--from-bin an indexed flat token file",
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json path")
    p.add_argument(
        "--train-bpe",
        type=int,
        default=None,
        metavar="VOCAB",
        help="train a byte-level BPE of VOCAB tokens on SRC, saved as --tokenizer "
        "(default OUT/tokenizer.json); an existing file there is reused",
    )
    p.add_argument("--field", default="text", help="JSON field holding the text (default: text)")
    p.add_argument("--member", default="txt", help="tar member holding the text (default: txt)")
    p.add_argument(
        "--seq-len", type=at_least(1), default=None, help="pack into sequences of this length"
    )
    p.add_argument("--shard-size", type=size, default=256 << 20, help="max token bytes/shard")
    p.add_argument(
        "--dtype",
        choices=("uint16", "uint32"),
        default=None,
        help="token dtype (default: uint16 if the vocabulary fits)",
    )
    p.add_argument("--eos-token", default=None, help="end-of-document token (default: detect)")
    p.add_argument(
        "--from-bin",
        action="store_true",
        help="SRC is a flat token file indexed by `unbroken data index`: cut its ids into "
        "token shards as they are (no tokenizer); same windows at --seq-len",
    )
    p.add_argument(
        "--workers", type=at_least(1), default=None, help="processes (default: CPU count)"
    )
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (faster, not durable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_stage(ds: Sub) -> None:
    p = add_command(
        ds,
        "stage",
        "copy a dataset from any fsspec URL to local disk, verified",
        "unbroken data stage s3://bucket/tok /nvme/tok --ranks-local",
        "Copy dataset.json + shards + indexes from URL (s3://, file://, a mount) into "
        "LOCAL_DIR in parallel, verifying checksums; valid files are skipped.",
        func=_stage,
    )
    p.add_argument("url", help="dataset root: local path or fsspec URL")
    p.add_argument("local_dir", help="local destination directory")
    p.add_argument("--workers", type=at_least(1), default=8, help="parallel transfers (default: 8)")
    p.add_argument(
        "--ranks-local",
        action="store_true",
        help="only LOCAL_RANK 0 copies; other local ranks wait for its marker",
    )
    p.add_argument(
        "--wait-timeout",
        type=at_least(0, float),
        default=3600.0,
        help="seconds non-zero local ranks wait (default: 3600)",
    )
    p.add_argument(
        "--retries",
        type=at_least(0),
        default=1,
        help="re-fetches on checksum mismatch (default: 1)",
    )
    p.add_argument("--fsync", action="store_true", help="fsync every staged file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _pack(a: argparse.Namespace) -> int:
    from unbroken.data.prepare.pack import pack

    r = pack(
        a.src,
        a.out,
        shard_size=a.shard_size,
        workers=a.workers,
        allow_partial=a.allow_partial,
        fsync=not a.no_fsync,
        progress=not a.no_progress,
        skip_bad=a.skip_bad,
    )
    m = r.manifest
    skipped = f"; {r.skipped} bad inputs skipped" if a.skip_bad else ""
    _say(
        f"{m.num_samples} samples in {len(m.shards)} shards ({r.shards_written} written, "
        f"{r.shards_reused} reused), {r.bytes / 1e6:.1f} MB in {r.seconds:.2f}s "
        f"({r.mb_per_s:.1f} MB/s); fingerprint {m.fingerprint}{skipped}"
    )
    return 0


def _index(a: argparse.Namespace) -> int:
    import os

    from unbroken.data.prepare.pack import index_directory

    if os.path.isfile(a.dir):
        from unbroken.data.tokens.flat import index_flat

        if a.meta is None and a.vocab_size is None and a.dtype is None:
            # the width would be a guess (uint16), and a uint32 file read as uint16 hands
            # the loop every token split in two
            raise ValueError(
                f"{printable(a.dir)}: a flat token file needs its vocabulary to know its "
                "token width; pass --meta meta.pkl (nanoGPT's), --vocab-size N, or --dtype "
                "uint16|uint32"
            )
        if a.meta is not None and not os.path.isfile(a.meta):
            raise ValueError(
                f"--meta {printable(a.meta)}: no such file; pass the meta.pkl written with "
                f"{printable(os.path.basename(a.dir))}, or --vocab-size N"
            )
        m = index_flat(a.dir, vocab_size=a.vocab_size, meta=a.meta, dtype=a.dtype)
        _say(
            f"indexed {printable(a.dir)} in place: {m.shards[0].tokens} {m.dtype} tokens, "
            f"vocabulary {m.vocab_size}; fingerprint {m.fingerprint}"
        )
        return 0

    r = index_directory(a.dir, workers=a.workers, progress=not a.no_progress)
    m = r.manifest
    _say(
        f"indexed {len(m.shards)} shards, {m.num_samples} samples in {r.seconds:.2f}s; "
        f"fingerprint {m.fingerprint}"
    )
    return 0


def _tokenize(a: argparse.Namespace) -> int:
    import os

    from unbroken.data.tokens.tokenizer import tokenize

    if a.from_bin:
        from unbroken.data.tokens.flat import flat_to_shards

        fm = flat_to_shards(
            a.src, a.out, seq_len=a.seq_len, shard_size=a.shard_size, fsync=not a.no_fsync
        )
        _say(
            f"{len(fm.shards)} token shards, {fm.num_samples} samples ({fm.dtype}) from "
            f"{printable(a.src)}; fingerprint {fm.fingerprint}"
        )
        return 0

    if os.path.isfile(a.src) and a.src.endswith(".bin"):
        # token ids, not text: read as JSONL it fails on its first bytes, saying nothing useful
        index = (
            ""
            if os.path.isfile(a.src + ".dataset.json")
            else (
                f"index it once (`unbroken data index {printable(a.src)} --meta meta.pkl`), then "
            )
        )
        raise ValueError(
            f"{printable(a.src)} is a flat token file, not text: {index}pass --from-bin "
            "(with --seq-len N) to cut it into token shards"
        )
    r = tokenize(
        a.src,
        a.out,
        tokenizer=a.tokenizer,
        train_bpe_vocab=a.train_bpe,
        field=a.field,
        member=a.member,
        seq_len=a.seq_len,
        shard_size=a.shard_size,
        dtype=a.dtype,
        eos_token=a.eos_token,
        workers=a.workers,
        fsync=not a.no_fsync,
        progress=not a.no_progress,
    )
    m = r.manifest
    _say(
        f"{r.documents} documents, {r.tokens} tokens ({m.dtype}) in {len(m.shards)} shards, "
        f"{m.num_samples} samples, {r.seconds:.2f}s ({r.tokens_per_s:,.0f} tokens/s); "
        f"fingerprint {m.fingerprint}"
    )
    return 0


def _stage(a: argparse.Namespace) -> int:
    from unbroken.data.prepare.stage import stage

    r = stage(
        a.url,
        a.local_dir,
        workers=a.workers,
        fsync=a.fsync,
        ranks_local=a.ranks_local,
        wait_timeout=a.wait_timeout,
        retries=a.retries,
        progress=not a.no_progress,
    )
    _say(r)
    return 0


# --- look and diagnose: inspect, bench, report -----------------------------------------------


def _add_inspect(ds: Sub) -> None:
    p = add_command(
        ds,
        "inspect",
        "per-epoch shuffle statistics of a dataset's streaming order",
        "unbroken data inspect ./data --epochs 3",
        "Print, per epoch, how well StreamingDataset shuffles DIR: mean absolute displacement "
        "(vs a random permutation), Spearman correlation of original index and position, share "
        "of consecutive samples from the same shard, correlation with the previous epoch, and "
        "the start of the shard order.",
        func=_inspect,
    )
    p.add_argument("dir", help="local dataset directory (holds dataset.json)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default: 0)")
    p.add_argument("--epochs", type=at_least(1), default=3, help="epochs to inspect (default: 3)")
    p.add_argument(
        "--shuffle-window",
        type=at_least(1),
        default=None,
        help="samples per window (default: StreamingDataset's)",
    )
    p.add_argument(
        "--seq-len", type=at_least(1), default=None, help="token datasets: tokens/sequence"
    )
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")


def _inspect(a: argparse.Namespace) -> int:
    import json

    from unbroken.data.diagnose.shuffle import format_shuffle_stats, shuffle_stats
    from unbroken.data.stream.dataset import StreamingDataset

    ds = StreamingDataset(
        a.dir, seed=a.seed, shuffle_window=a.shuffle_window, seq_len=a.seq_len, rank=0, world_size=1
    )
    stats = shuffle_stats(ds, a.epochs)
    if a.json:
        for s in stats:
            _say(json.dumps(s.to_json()))
    else:
        _say(format_shuffle_stats(ds, stats))
    return 0


def _add_bench(ds: Sub) -> None:
    p = add_command(
        ds,
        "bench",
        "time each input-pipeline stage alone and name the one that limits",
        "unbroken data bench ./data --batch-size 64 --transform train.py:decode --consume-rate 900",
        "Run each stage alone on DIR - (network,) shard read, decode/transform, collate, "
        "worker transport, pin, H2D - print each one's samples/s next to the consumer's rate, "
        "name the stage that limits, and suggest num_workers and prefetch_factor (and, for a "
        "remote URL, the prefetch depth in shards).",
        func=_bench,
    )
    p.add_argument("dir", help="dataset directory or fsspec URL (holds dataset.json)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="remote URL: where the scratch cache goes (default: the temp dir)",
    )
    p.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help='remote URL: fsspec options, e.g. \'{"endpoint_url": "http://..."}\'',
    )
    p.add_argument(
        "--batch-size", type=at_least(1), default=32, help="samples per batch (default: 32)"
    )
    p.add_argument(
        "--num-workers",
        type=at_least(0),
        default=None,
        help="DataLoader workers to evaluate (default: cores - 1)",
    )
    p.add_argument(
        "--consume-rate",
        type=float,
        default=None,
        help="samples/s the model consumes (or use --timeline)",
    )
    p.add_argument(
        "--timeline",
        default=None,
        help="RUN_DIR or data_steps.csv of a run: consumer rate from its compute time",
    )
    p.add_argument(
        "--transform",
        default="basic",
        help="per-sample decode: 'basic' (by extension, default), 'none', "
        "'package.module:function' or 'path/to/train.py:function' (a function "
        "defined in your training script; its __main__ block does not run)",
    )
    p.add_argument(
        "--seq-len", type=at_least(1), default=None, help="token datasets: tokens/sequence"
    )
    p.add_argument(
        "--device",
        default=None,
        help="device for the pin and H2D stages (default: cuda when available)",
    )
    p.add_argument("--batches", type=at_least(2), default=50, help="batches to time (default: 50)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=20.0,
        help="time budget of the whole bench (default: 20)",
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle seed of the order read")
    p.add_argument(
        "--out",
        default=None,
        help="RUN_DIR to write data_bench.json into (for `unbroken data report`)",
    )
    p.add_argument("--metrics", default=None, help="metric log (.jsonl) to append the rates to")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _bench(a: argparse.Namespace) -> int:
    import json

    from unbroken.data.diagnose.bench import run_bench

    try:
        opts = None if a.storage_options is None else json.loads(a.storage_options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--storage-options {a.storage_options!r} is not JSON ({e})") from None
    report, path = run_bench(
        a.dir,
        batch_size=a.batch_size,
        num_workers=a.num_workers,
        consume_rate=a.consume_rate,
        timeline=a.timeline,
        transform=a.transform,
        seq_len=a.seq_len,
        device=a.device,
        num_batches=a.batches,
        max_seconds=a.max_seconds,
        seed=a.seed,
        out=a.out,
        metrics=a.metrics,
        cache_dir=a.cache_dir,
        storage_options=opts,
    )
    _say(json.dumps(report.to_json()) if a.json else report.format())
    if path is not None:
        _say(f"wrote {path}")
    return 0


def _add_report(ds: Sub) -> None:
    p = add_command(
        ds,
        "report",
        "stall summary, sawtooth check and a PNG of a run's step timeline and stages",
        "unbroken data report ./run --out stalls.png",
        "Read RUN_DIR/data_steps.csv (StepTimer) and/or RUN_DIR/data_bench.json (data bench "
        "--out), print the stall summary, the sawtooth verdict and the stage table, and write a "
        "PNG (needs matplotlib: pip install 'unbroken[plot]').",
        func=_report,
    )
    p.add_argument("run_dir", help="directory holding data_steps.csv and/or data_bench.json")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/data_report.png)")
    p.add_argument(
        "--num-workers",
        type=at_least(1),
        default=None,
        help="workers of the run, to relate a sawtooth period to (default: from "
        "the timeline header)",
    )
    p.add_argument("--no-plot", action="store_true", help="text only")


def _report(a: argparse.Namespace) -> int:
    from unbroken.data.diagnose.plot import run_report

    text, png = run_report(a.run_dir, out=a.out, num_workers=a.num_workers, plot=not a.no_plot)
    _say(text)
    if png is not None:
        _say(f"wrote {png}")
    return 0


def add_data(sub: Sub) -> None:
    g = add_command(
        sub,
        "data",
        "prepare datasets, inspect their order, find input stalls",
        "unbroken data pack ./raw-files ./data",
    )
    ds = g.add_subparsers(dest="data_cmd", required=True, metavar="COMMAND")
    for add in (
        _add_pack,
        _add_index,
        _add_tokenize,
        _add_stage,
        _add_inspect,
        _add_bench,
        _add_report,
    ):
        add(ds)
