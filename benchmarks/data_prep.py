"""Data preparation benchmark: pack, tokenize and stage, side by side with the anchors.

Run from the anchor venv (MosaicML Streaming and LitData need torchvision, kept out of .venv):

    bash benchmarks/_anchor_env.sh
    .venv-bench/bin/python benchmarks/data_prep.py            # full: 100,000 samples (~400 MB)
    .venv-bench/bin/python benchmarks/data_prep.py --quick    # 10,000 samples, 1 round

Pack: the same 100,000 in-memory samples (2-6 KB random bytes + a small JSON each, generated
deterministically) written by webdataset.ShardWriter, MosaicML MDSWriter, litdata.optimize
and `unbroken.data.prepare.pack` (tar + .idx + dataset.json), 64 MB shards for all. Tools run
interleaved, round after round, and the median is reported, because the CPU is shared.
Tokenize: `unbroken tokenize` (JSONL -> token shards, 2 workers) vs the tokenizer's own
`encode_batch` in one process, with its Rust thread pool on (default) and off.
Stage: `unbroken stage` local -> local vs `cp -r`, same source, page cache warm for both.
All data lives under --tmp (default /tmp/unbroken-bench-prep) and is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_SHARD = 64 << 20
OURS = "unbroken pack (fsync)"


def _samples(n: int, tmp: str) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    sizes = rng.integers(2048, 6145, n)
    blob = rng.bytes(int(sizes.sum()))
    offs = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    np.save(f"{tmp}/blob.npy", np.frombuffer(blob, dtype=np.uint8))
    np.save(f"{tmp}/offs.npy", np.asarray(offs, dtype=np.int64))
    os.environ["UNBROKEN_BENCH_BLOB"] = tmp
    return [
        {
            "__key__": f"{i:08d}",
            "bin": blob[offs[i] : offs[i + 1]],
            "json": json.dumps({"i": i, "label": i % 1000, "split": "train"}).encode(),
        }
        for i in range(n)
    ]


_DATA: list[dict[str, Any]] = []
_LIT: dict[str, Any] = {}


def _lit_fn(i: int) -> dict[str, Any]:
    # litdata's workers are fresh processes: they read the same bytes from a memory-mapped
    # copy (page cache) instead of receiving 400 MB of pickled inputs.
    if not _LIT:
        d = os.environ["UNBROKEN_BENCH_BLOB"]
        _LIT.update(blob=np.load(f"{d}/blob.npy", mmap_mode="r"), offs=np.load(f"{d}/offs.npy"))
    a, b = int(_LIT["offs"][i]), int(_LIT["offs"][i + 1])
    return {
        "key": f"{i:08d}",
        "bin": _LIT["blob"][a:b].tobytes(),
        "json": json.dumps({"i": i, "label": i % 1000, "split": "train"}).encode(),
    }


def _cpu() -> float:
    """CPU seconds (user + system) of this process and its reaped children so far."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class _Timer:
    """Wall and CPU time of one run; CPU time is the contention-robust measure of work."""

    def __enter__(self) -> _Timer:
        self.w0, self.c0 = time.perf_counter(), _cpu()
        return self

    def __exit__(self, *_: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.w0, _cpu() - self.c0


def _fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def pack_tools(tmp: str) -> dict[str, Callable[[], str]]:
    tools: dict[str, Callable[[], str]] = {}

    def ours(workers: int, fsync: bool) -> Callable[[], str]:
        def run() -> str:
            from unbroken.data.prepare.pack import pack

            out = _fresh(f"{tmp}/ours-{workers}-{fsync}")
            pack(_DATA, out, shard_size=_SHARD, workers=workers, progress=False, fsync=fsync)
            return out

        return run

    tools[OURS] = ours(1, True)
    tools["unbroken pack (no fsync)"] = ours(1, False)
    try:
        import webdataset as wds

        def wds_writer() -> str:
            out = _fresh(f"{tmp}/wds")
            with wds.ShardWriter(f"{out}/s-%06d.tar", maxsize=_SHARD, verbose=0) as w:
                for s in _DATA:
                    w.write(s)
            return out

        tools["webdataset.ShardWriter"] = wds_writer
    except ImportError:
        print("webdataset not installed: skipped", file=sys.stderr)
    try:
        from streaming import MDSWriter

        def mds() -> str:
            out = f"{tmp}/mds"
            shutil.rmtree(out, ignore_errors=True)
            cols = {"key": "str", "bin": "bytes", "json": "bytes"}
            with MDSWriter(out=out, columns=cols, size_limit=_SHARD) as w:
                for s in _DATA:
                    w.write({"key": s["__key__"], "bin": s["bin"], "json": s["json"]})
            return out

        tools["MosaicML MDSWriter"] = mds
    except ImportError:
        print("mosaicml-streaming not installed: skipped", file=sys.stderr)
    try:
        import litdata

        def lit() -> str:
            out = f"{tmp}/litdata"
            shutil.rmtree(out, ignore_errors=True)
            litdata.optimize(
                fn=_lit_fn,
                inputs=list(range(len(_DATA))),
                output_dir=out,
                chunk_bytes=_SHARD,
                num_workers=os.cpu_count() or 1,
                verbose=False,
                mode="overwrite",
            )
            return out

        tools["litdata.optimize"] = lit
    except ImportError:
        print("litdata not installed: skipped", file=sys.stderr)
    return tools


Times = dict[str, list[tuple[float, float]]]  # tool -> [(wall, cpu), ...]


def bench_pack(tmp: str, rounds: int) -> tuple[Times, dict[str, int], str]:
    tools = pack_tools(tmp)
    times: Times = {k: [] for k in tools}
    sizes: dict[str, int] = {}
    ours_out = ""
    for r in range(rounds):
        names = list(tools) if r % 2 == 0 else list(reversed(tools))
        for name in names:
            subprocess.run(["sync"], check=True)  # no earlier run's writeback in this one
            with _Timer() as t:
                out = tools[name]()
            times[name].append((t.wall, t.cpu))
            sizes[name] = _du(out)
            if name == OURS:
                ours_out = out
            print(f"  round {r + 1} {name}: {t.wall:.2f}s wall, {t.cpu:.2f}s cpu", file=sys.stderr)
    return times, sizes, ours_out


_VARIANTS = {
    "ascii": lambda t: t,
    "one-accent": lambda t: t.replace(" ", " café ", 1),  # one non-ASCII word per document
    "e-accent": lambda t: t.replace("e", "é"),  # most words non-ASCII
}


def _corpus(path: str, docs: int, variant: str = "ascii") -> list[str]:
    rng = np.random.default_rng(1)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(rng.integers(2, 10)))) for _ in range(20000)]
    p = 1 / np.arange(1, len(words) + 1)
    p /= p.sum()
    texts = []
    with open(path, "w") as f:
        for _ in range(docs):
            idx = rng.choice(len(words), int(rng.integers(50, 400)), p=p)
            t = _VARIANTS[variant](" ".join(words[i] for i in idx) + ".")
            texts.append(t)
            f.write(json.dumps({"text": t}) + "\n")
    return texts


def _tokenize_child(mode: str, tmp: str) -> None:
    """One timed tokenization in a fresh process (``--child``): prints wall, CPU, tokens.

    A fresh process per run because the tokenizers library keeps thread-pool state across
    calls and forks, which made in-process on/off comparisons depend on their order.
    """
    from tokenizers import Tokenizer

    src, tok = f"{tmp}/corpus.jsonl", f"{tmp}/tokenizer.json"
    if mode == "ours":
        from unbroken.data.tokens.tokenizer import tokenize

        with _Timer() as t:
            res = tokenize(
                src,
                _fresh(f"{tmp}/tok-out"),
                tokenizer=tok,
                seq_len=1024,
                workers=2,
                progress=False,
            )
        n = res.tokens - res.documents  # EOS separators excluded
    else:
        texts = [json.loads(line)["text"] for line in open(src)]
        tk = Tokenizer.from_file(tok)
        with _Timer() as t:
            n = sum(len(e.ids) for e in tk.encode_batch(texts))
    print(json.dumps({"wall": t.wall, "cpu": t.cpu, "tokens": n}))


def bench_tokenize(tmp: str, docs: int, rounds: int, variant: str) -> tuple[Times, int]:
    from unbroken.data.tokens.tokenizer import train_bpe

    texts = _corpus(f"{tmp}/corpus.jsonl", docs, variant)
    train_bpe(texts[:2000], 8192, f"{tmp}/tokenizer.json")
    runs = {
        "unbroken tokenize (2 workers)": ("ours", None),
        "encode_batch, 1 process (rayon on)": ("encode", "true"),
        "encode_batch, 1 process (rayon off)": ("encode", "false"),
    }
    times: Times = {k: [] for k in runs}
    counts = set()
    for r in range(rounds):
        for name in runs if r % 2 == 0 else reversed(list(runs)):
            mode, par = runs[name]
            env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
            if par is not None:
                env["TOKENIZERS_PARALLELISM"] = par
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--tmp", tmp],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            res = json.loads(out.strip().splitlines()[-1])
            counts.add(res["tokens"])
            times[name].append((res["wall"], res["cpu"]))
            print(
                f"  round {r + 1} {name}: {res['wall']:.2f}s wall, {res['cpu']:.2f}s cpu",
                file=sys.stderr,
            )
    if len(counts) != 1:
        raise RuntimeError(f"token counts differ between tools: {counts}")
    return times, counts.pop()


def bench_stage(src: str, tmp: str, rounds: int) -> tuple[Times, int]:
    from unbroken.data.prepare.stage import stage

    times: Times = {"unbroken stage": [], "cp -r": []}
    for r in range(rounds):
        for name in times if r % 2 == 0 else reversed(list(times)):
            dst = f"{tmp}/staged"
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)  # no earlier run's writeback in this one
            with _Timer() as t:
                if name == "cp -r":
                    subprocess.run(["cp", "-r", src, dst], check=True)
                else:
                    stage(src, dst, progress=False)
            times[name].append((t.wall, t.cpu))
            print(f"  round {r + 1} {name}: {t.wall:.2f}s wall, {t.cpu:.2f}s cpu", file=sys.stderr)
    return times, _du(src)


def _med(ts: list[tuple[float, float]], i: int) -> float:
    return statistics.median(t[i] for t in ts)


def _row(name: str, ts: list[tuple[float, float]], work: float, unit: str, ref: Any) -> str:
    wall, cpu = _med(ts, 0), _med(ts, 1)
    ratio = f"{wall / _med(ref, 0):.2f}" if ref else "-"
    cratio = f"{cpu / _med(ref, 1):.2f}" if ref else "-"
    spread = f"{min(t[0] for t in ts):.2f}-{max(t[0] for t in ts):.2f}"
    return (
        f"| {name} | {wall:.2f} ({spread}) | {work / wall:,.1f} {unit} | {ratio} | {cpu:.2f} | "
        f"{cratio} |"
    )


_HEAD = "| tool | wall s, median (range) | throughput | wall ratio | CPU s | CPU ratio |\n|---|---|---|---|---|---|"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--docs", type=int, default=20_000, help="tokenize corpus documents")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="10,000 samples, 2,000 docs, 1 round")
    ap.add_argument("--tmp", default="/tmp/unbroken-bench-prep")
    ap.add_argument(
        "--only",
        default="pack,tokenize,stage",
        help="comma-separated parts to run (stage needs pack's output)",
    )
    ap.add_argument(
        "--text",
        choices=sorted(_VARIANTS),
        default="ascii",
        help="tokenize corpus: ASCII words (default), one accented word per document, or "
        "every 'e' accented",
    )
    ap.add_argument("--child", choices=("ours", "encode"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _tokenize_child(a.child, a.tmp)
        return
    if a.quick:
        a.samples, a.docs, a.rounds = 10_000, 2_000, 1
    parts = set(a.only.split(","))
    if not parts <= {"pack", "tokenize", "stage"}:
        ap.error(f"--only {a.only!r}: pick from pack, tokenize, stage")
    if "stage" in parts:
        parts.add("pack")
    tmp = _fresh(a.tmp)
    print(
        f"\nCPU: {os.cpu_count()} cores, shared with other jobs; {a.rounds} interleaved rounds, "
        "median (range); CPU s = user+system of the process and its children.\n"
    )
    if "pack" in parts:
        _DATA.extend(_samples(a.samples, tmp))
        payload = sum(len(s["bin"]) + len(s["json"]) for s in _DATA)
        print(f"pack: {a.samples} samples, {payload / 1e6:.0f} MB payload", file=sys.stderr)
        pt, sizes, packed = bench_pack(tmp, a.rounds)
        print(
            f"Pack {a.samples:,} samples ({payload / 1e6:.0f} MB payload), 64 MB shards; ratios "
            "are vs MosaicML MDSWriter (goal: wall ratio <= 1.0):\n"
        )
        print(_HEAD)
        ref = pt.get("MosaicML MDSWriter")
        for name, ts in pt.items():
            print(
                _row(name, ts, payload / 1e6, "MB/s", ref) + f" output {sizes[name] / 1e6:.0f} MB"
            )
    if "tokenize" in parts:
        tt, ntok = bench_tokenize(tmp, a.docs, a.rounds, a.text)
        print(
            f"\nTokenize {a.docs:,} documents ({ntok:,} tokens, text {a.text!r}), byte-level BPE "
            "8192; ratios are "
            "vs encode_batch in one process, rayon on (goal: speed-up = 1/ratio >= 1.7):\n"
        )
        print(_HEAD)
        ref = tt["encode_batch, 1 process (rayon on)"]
        for name, ts in tt.items():
            print(_row(name, ts, ntok / 1e6, "M tokens/s", ref))
    if "stage" in parts:
        st, sbytes = bench_stage(packed, tmp, a.rounds)
        print(
            f"\nStage local -> local, {sbytes / 1e6:.0f} MB (page cache warm for both); ratios "
            "are vs cp -r (goal: throughput >= 90% of cp, i.e. wall ratio <= 1.11):\n"
        )
        print(_HEAD)
        ref = st["cp -r"]
        for name, ts in st.items():
            print(_row(name, ts, sbytes / 1e9, "GB/s", ref))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
