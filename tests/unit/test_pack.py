"""`pack` inputs (directory tree, JSONL, dicts), its bad-input errors, disk full, and resume."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from typing import Any

import numpy as np
import pytest

from unbroken.common.fs import HashingWriter
from unbroken.data.manifest import DatasetManifest
from unbroken.data.prepare.pack import pack
from unbroken.data.tar.reader import ShardReader


def _tree(root: str, n: int = 40, seed: int = 0) -> dict[str, dict[str, bytes]]:
    rng = np.random.default_rng(seed)
    want: dict[str, dict[str, bytes]] = {}
    for i in range(n):
        key = f"part{i % 3}/{i:04d}"
        os.makedirs(os.path.join(root, os.path.dirname(key)), exist_ok=True)
        members = {"jpg": rng.bytes(int(rng.integers(10, 4000))), "json": b'{"i": %d}' % i}
        for ext, data in members.items():
            with open(os.path.join(root, f"{key}.{ext}"), "wb") as f:
                f.write(data)
        want[key] = members
    return want


def _read(root: str) -> list[dict[str, Any]]:
    m = DatasetManifest.load(root)
    return [s for i in range(len(m.shards)) for s in ShardReader(m.shard_path(root, i))]


def _files(root: str) -> dict[str, bytes]:
    return {n: open(os.path.join(root, n), "rb").read() for n in sorted(os.listdir(root))}


def test_directory_samples_grouped_by_key(tmp_path: str) -> None:
    src, out = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "out")
    want = _tree(src)
    open(os.path.join(src, ".DS_Store"), "w").write("junk")  # hidden files are skipped
    res = pack(src, out, shard_size=20_000, workers=1, progress=False)
    got = _read(out)
    assert [g["__key__"] for g in got] == sorted(want)
    for g in got:
        assert {k: v for k, v in g.items() if k != "__key__"} == want[str(g["__key__"])]
    assert res.shards_written == len(res.manifest.shards) > 3
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]


def test_file_without_extension_cannot_be_grouped(tmp_path: str) -> None:
    _tree(str(tmp_path), 4)
    open(os.path.join(tmp_path, "part0", "README"), "w").write("x")
    with pytest.raises(ValueError, match=r"part0/README: cannot group this file.*no extension"):
        pack(str(tmp_path), os.path.join(tmp_path, "..", "o1"), progress=False)


def test_missing_member_named_with_key_and_fix(tmp_path: str) -> None:
    src = os.path.join(tmp_path, "src")
    _tree(src, 6)
    os.unlink(os.path.join(src, "part1", "0004.json"))
    out = os.path.join(tmp_path, "out")
    with pytest.raises(ValueError, match=r"sample 'part1/0004'.*missing \['json'\].*allow.partial"):
        pack(src, out, workers=1, progress=False)
    assert not os.path.exists(os.path.join(out, "dataset.json"))
    res = pack(src, out, workers=1, allow_partial=True, progress=False)
    assert res.manifest.num_samples == 6


def test_sample_larger_than_shard_size(tmp_path: str) -> None:
    samples = [{"__key__": "small", "bin": b"x"}, {"__key__": "huge", "bin": b"x" * 50_000}]
    with pytest.raises(ValueError, match=r"sample 'huge' needs \d+ bytes.*larger --shard-size"):
        pack(samples, str(tmp_path), shard_size=20_000, progress=False)
    assert not os.path.exists(os.path.join(tmp_path, "dataset.json"))


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        ({"__key__": "a.b", "x": b""}, "sample key 'a.b' is not usable"),
        ({"__key__": "../up", "x": b""}, "sample key '../up' is not usable"),
        ({"__key__": "k", "x": object()}, "member 'x' has type object"),
        ({"__key__": "k"}, "has no members"),
    ],
)
def test_bad_dict_samples(tmp_path: str, sample: dict[str, object], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        pack([sample], str(tmp_path), progress=False)


def test_dict_values_are_encoded(tmp_path: str) -> None:
    pack([{"txt": "héllo", "cls": 3, "json": {"b": 1, "a": [1]}}], str(tmp_path), progress=False)
    assert _read(str(tmp_path)) == [
        {"__key__": "000000000", "txt": "héllo".encode(), "cls": b"3", "json": b'{"a":[1],"b":1}'}
    ]


def test_jsonl_lines_become_samples(tmp_path: str) -> None:
    src = os.path.join(tmp_path, "in.jsonl")
    lines = [json.dumps({"text": "w" * i}) for i in range(200)]
    with open(src, "w") as f:
        f.write("\n".join(lines[:100]) + "\n\n" + "\n".join(lines[100:]) + "\n")
    out = os.path.join(tmp_path, "out")
    res = pack(src, out, shard_size=15_000, workers=2, progress=False)
    got = _read(out)
    assert [g["json"] for g in got] == [ln.encode() for ln in lines]
    assert got[100]["__key__"] == "000000101"  # keys are source line numbers (0-based)
    assert len(res.manifest.shards) > 3


def _full_disk(limit: int) -> object:
    """A HashingWriter.write that raises ENOSPC once ``limit`` bytes were written in total."""
    orig = HashingWriter.write
    total = [0]

    def write(w: HashingWriter, b: object) -> int:
        n = memoryview(b).nbytes  # type: ignore[arg-type]
        if total[0] + n > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        total[0] += n
        return orig(w, b)

    return write


def test_disk_full_during_pack_leaves_no_partial_output(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = [{"__key__": f"s{i}", "bin": bytes(3000)} for i in range(200)]
    monkeypatch.setattr(HashingWriter, "write", _full_disk(150_000))
    # gather writes go through the failing write, buffer by buffer
    monkeypatch.setattr(HashingWriter, "writev", lambda w, bufs: sum(w.write(b) for b in bufs))
    with pytest.raises(RuntimeError, match=r"shard-0000\d\d\.tar: disk full.*free space"):
        pack(samples, str(tmp_path), shard_size=50_000, workers=1, progress=False)
    names = os.listdir(tmp_path)
    assert "dataset.json" not in names and not [n for n in names if n.startswith(".tmp-")]
    monkeypatch.undo()
    res = pack(samples, str(tmp_path), shard_size=50_000, workers=1, progress=False)
    assert res.shards_reused >= 1 and res.manifest.num_samples == 200  # resumes, not restarts


def test_disk_full_on_a_real_tiny_tmpfs(tmp_path: str) -> None:
    mnt = os.path.join(tmp_path, "mnt")
    os.makedirs(mnt)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mnt], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); ENOSPC is covered above"
        )
    try:
        samples = [{"__key__": f"s{i}", "bin": bytes(3000)} for i in range(200)]
        with pytest.raises(RuntimeError, match="disk full"):
            pack(samples, mnt, shard_size=50_000, workers=1, progress=False)
        assert "dataset.json" not in os.listdir(mnt)
        assert not [n for n in os.listdir(mnt) if n.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", mnt], check=False)


def test_resume_keeps_verified_shards_and_rewrites_damaged_ones(tmp_path: str) -> None:
    src, out, ref = (os.path.join(tmp_path, n) for n in ("src", "out", "ref"))
    _tree(src, 60)
    first = pack(src, out, shard_size=20_000, workers=1, progress=False)
    n = len(first.manifest.shards)
    pack(src, ref, shard_size=20_000, workers=1, progress=False)
    os.unlink(os.path.join(out, "shard-000001.tar.idx"))  # as if killed before the index
    with open(os.path.join(out, "shard-000002.tar"), "r+b") as f:  # bit rot
        f.seek(700)
        b = f.read(1)
        f.seek(700)
        f.write(bytes([b[0] ^ 1]))
    open(os.path.join(out, ".tmp-shard-000003.tar.deadbeef"), "w").write("partial")
    again = pack(src, out, shard_size=20_000, workers=1, progress=False)
    assert (again.shards_written, again.shards_reused) == (2, n - 2)
    assert again.manifest == first.manifest
    assert _files(out) == _files(ref)


def test_changed_input_invalidates_only_affected_shards(tmp_path: str) -> None:
    src, out = os.path.join(tmp_path, "src"), os.path.join(tmp_path, "out")
    _tree(src, 60)
    first = pack(src, out, shard_size=20_000, workers=1, progress=False)
    p = os.path.join(src, "part2", "0059.jpg")
    with open(p, "r+b") as f:  # same size, new content, new mtime
        f.write(b"changed!")
    os.utime(p, ns=(1, 1))
    again = pack(src, out, shard_size=20_000, workers=1, progress=False)
    assert again.shards_written == 1 and again.manifest.fingerprint != first.manifest.fingerprint
    assert _read(out)[-1]["jpg"][:8] == b"changed!"


def _tarfile_shards(samples: list[dict[str, bytes]], counts: list[int]) -> list[bytes]:
    """What Python's tarfile writes (ustar/PAX, mtime 0) for the same shard cuts."""
    import io
    import tarfile

    out, i = [], 0
    for n in counts:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for s in samples[i : i + n]:
                for ext, data in s.items():
                    if ext == "__key__":
                        continue
                    ti = tarfile.TarInfo(f"{s['__key__'].decode()}.{ext}")
                    ti.size, ti.mode, ti.mtime, ti.uname, ti.gname = len(data), 0o644, 0, "", ""
                    tf.addfile(ti, io.BytesIO(data))
        out.append(buf.getvalue())
        i += n
    return out


def test_column_and_per_sample_paths_write_tarfile_bytes(tmp_path: str) -> None:
    """Sizes around the 512-byte block and the inline threshold, empty members, long (PAX)
    names and a last member of either kind: the column path (all values bytes, same fields)
    and the per-sample path (bytearray values) both write exactly tarfile's bytes."""
    rng = np.random.default_rng(3)
    edge = [0, 1, 511, 512, 513, 1023, 1024, 1025, 1536, 3000]
    samples: list[dict[str, bytes]] = []
    for i in range(700):
        key = f"{i:06d}" if i % 97 else f"dir/{'l' * (90 + i % 30)}{i}"  # some need PAX
        a, c = edge[i % len(edge)], edge[(i * 7) % len(edge)]
        samples.append({"__key__": key.encode(), "a": rng.bytes(a), "c": rng.bytes(c)})

    def dicts(kind: type) -> list[dict[str, object]]:
        return [
            {"__key__": s["__key__"].decode(), "a": kind(s["a"]), "c": kind(s["c"])}
            for s in samples
        ]

    outs = []
    for kind in (bytes, bytearray):
        out = os.path.join(tmp_path, kind.__name__)
        res = pack(dicts(kind), out, shard_size=200_000, workers=1, progress=False, fsync=False)
        outs.append({n: b for n, b in _files(out).items() if not n.startswith(".")})
    assert outs[0] == outs[1]
    counts = [s.samples for s in res.manifest.shards]
    assert len(counts) > 3
    ref = _tarfile_shards(samples, counts)
    for i, want in enumerate(ref):
        got = outs[0][f"shard-{i:06d}.tar"]
        # tarfile pads to a 10240-byte record too; the member bytes must match exactly
        assert got == want, f"shard {i} differs from tarfile's output"


def test_rerun_with_changed_bytes_of_equal_size_rewrites_only_that_shard(tmp_path: str) -> None:
    """In-memory input: the plan covers keys and sizes, the content is checked through the
    checksum of the tar that would be written, so a same-size edit is never kept stale."""
    samples = [{"__key__": f"s{i:04d}", "bin": bytes([i % 256]) * 2000} for i in range(120)]
    first = pack(samples, str(tmp_path), shard_size=60_000, workers=1, progress=False)
    samples[-1]["bin"] = b"\xff" * 2000
    again = pack(samples, str(tmp_path), shard_size=60_000, workers=1, progress=False)
    n = len(first.manifest.shards)
    assert (again.shards_written, again.shards_reused) == (1, n - 1)
    assert _read(str(tmp_path))[-1]["bin"] == b"\xff" * 2000


def test_gather_write_survives_short_writes(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """writev may write fewer bytes than asked (signals, quotas); the rest is written and
    the size and checksum still describe exactly the bytes given."""
    from unbroken.common.fs import checksum_bytes, checksum_file

    real = os.writev

    def short(fd: int, bufs: list[bytes]) -> int:
        joined = b"".join(bufs)
        return real(fd, [joined[: max(1, len(joined) // 3)]])  # a third, as a kernel may

    monkeypatch.setattr(os, "writev", short)
    bufs = [b"a" * 700, memoryview(b"bc" * 300), bytearray(b"d" * 5), b"", b"e" * 4096] * 300
    path = os.path.join(tmp_path, "f")
    w = HashingWriter(path, fsync=False)
    n = w.writev(bufs)
    w.close()
    want = b"".join(bytes(b) for b in bufs)
    assert n == w.size == len(want)
    assert open(path, "rb").read() == want
    assert w.digest == checksum_bytes(want) == checksum_file(path)[1]


# --- bad input is refused by name, or skipped and counted (issue 12 item 11) -----------------


def test_malformed_jsonl_lines_are_named_by_file_and_line_or_skipped(tmp_path: str) -> None:
    src = os.path.join(tmp_path, "in.jsonl")
    with open(src, "wb") as f:
        f.write(b'{"a": 1}\nnot json\n{"b": 2}\n\n{"c": \n{"d": "\xff\xfe"}\n{"e": 5}\n')
    out = os.path.join(tmp_path, "out")
    with pytest.raises(ValueError, match=r"in\.jsonl:2: not a JSON line .*--skip-bad"):
        pack(src, out, progress=False)
    res = pack(src, out, progress=False, skip_bad=True)
    assert res.skipped == 3  # lines 2, 5 and 6 (invalid UTF-8)
    got = _read(out)
    assert [g["json"] for g in got] == [b'{"a": 1}', b'{"b": 2}', b'{"e": 5}']
    assert [g["__key__"] for g in got] == ["000000000", "000000002", "000000006"]


def test_symlink_loop_unreadable_file_and_non_utf8_name_are_named_or_skipped(
    tmp_path: str,
) -> None:
    root = os.path.join(tmp_path, "src")
    want = _tree(root, 9)
    out = os.path.join(tmp_path, "out")
    loop = os.path.join(root, "part0", "loop")
    os.symlink("..", loop)  # leads back to a directory above itself
    with pytest.raises(ValueError, match=r"part0/loop: symlink loop"):
        pack(root, out, progress=False)
    os.unlink(loop)
    jpg = os.path.join(root, "part1", "0004.jpg")
    os.unlink(jpg)
    os.symlink("gone.jpg", jpg)  # dangling: the file cannot be read
    with pytest.raises(ValueError, match=r"part1/0004\.jpg: cannot read"):
        pack(root, out, progress=False)
    os.unlink(jpg)
    os.symlink("0001.jpg", jpg)
    open(os.path.join(os.fsencode(root), b"part2", b"\xff\xfe.jpg"), "wb").write(b"x")
    with pytest.raises(ValueError, match=r"xff\\xfe\.jpg': file name is not UTF-8"):
        pack(root, out, progress=False)
    os.unlink(jpg)
    os.symlink("gone.jpg", jpg)
    os.symlink("..", loop)
    res = pack(root, out, progress=False, skip_bad=True)
    assert res.skipped == 3  # the loop, the dangling file (its whole sample), the bad name
    got = {str(g["__key__"]): g for g in _read(out)}
    assert set(got) == set(want) - {"part1/0004"}
    for key, members in got.items():
        assert {k: v for k, v in members.items() if k != "__key__"} == want[key]


def test_output_path_that_is_a_file_and_index_of_a_file_are_errors(tmp_path: str) -> None:
    from unbroken.cli import main
    from unbroken.data.prepare.pack import index_directory

    src = os.path.join(tmp_path, "in.jsonl")
    open(src, "w").write('{"a": 1}\n')
    with pytest.raises(ValueError, match="exists and is not a directory"):
        pack(src, src, progress=False)
    with pytest.raises(ValueError, match="not a directory; `unbroken data index DIR`"):
        index_directory(src)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        index_directory(os.path.join(tmp_path, "nope"))
    assert main(["data", "pack", src, src, "--no-progress"]) == 2
    assert main(["data", "index", src]) == 2


def test_a_pack_that_fails_before_it_writes_leaves_the_dataset_it_would_replace(
    tmp_path: str,
) -> None:
    """Bad input is refused and loses nothing: a JSONL with a bad line packed into an
    existing dataset leaves that dataset readable (its manifest goes only when a shard of
    it is about to change)."""
    good, bad = os.path.join(tmp_path, "in.jsonl"), os.path.join(tmp_path, "bad.jsonl")
    with open(good, "w") as f:
        f.writelines(json.dumps({"i": i}) + "\n" for i in range(50))
    with open(bad, "w") as f:
        f.write("not json\n")
    out = os.path.join(tmp_path, "out")
    pack(good, out, progress=False)
    before = _files(out)
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        pack(bad, out, progress=False)
    assert _files(out) == before
    assert len(_read(out)) == 50


def test_a_directory_is_not_packed_into_itself(tmp_path: str) -> None:
    """`pack raw raw/out` would take its own shards as samples on the next run."""
    src = os.path.join(tmp_path, "raw")
    _tree(src, n=5)
    for out in (src, os.path.join(src, "out")):
        with pytest.raises(ValueError, match="inside the directory it packs") as e:
            pack(src, out, progress=False)
        assert out in str(e.value) and "outside" in str(e.value)
    assert not os.path.exists(os.path.join(src, "out"))
    assert not any(n.endswith(".tar") for n in os.listdir(src))


@pytest.mark.timeout(60)
def test_a_failed_pack_ends_its_workers_in_a_process_that_handles_sigterm(tmp_path: str) -> None:
    """A caller with a SIGTERM handler of its own (a training process: the Checkpointer's
    preemption flag) forks pack's workers with it; stopping them on an error then did
    nothing and the pack hung in the pool's join for good."""
    import signal

    src = os.path.join(tmp_path, "in.jsonl")
    with open(src, "w") as f:
        f.writelines(json.dumps({"i": i, "pad": "x" * 2000}) + "\n" for i in range(3000))
        f.write("not json\n")
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # noted, not obeyed
    try:
        with pytest.raises(ValueError, match=r"in\.jsonl:3001"):
            pack(src, os.path.join(tmp_path, "out"), shard_size=1 << 20, workers=2, progress=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
