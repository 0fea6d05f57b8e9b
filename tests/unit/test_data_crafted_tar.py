"""Crafted tar shards and indexes (T-NO-WRONG-BYTE, T-BOUNDED): what ``unbroken data index``
and ``ShardReader`` do with a foreign or hostile tar - a member name that is not UTF-8, a
GNU long-name or PAX header whose size field lies by terabytes - and with an index whose
member spans overflow int64 on their way past the structure check.

The outcome is a ``ShardError`` naming the file (and the member), in memory bounded by the
file: never a ``UnicodeEncodeError`` or ``MemoryError`` from inside, never a member that is
not in the tar handed to the loop.
"""

from __future__ import annotations

import io
import os
import random
import resource
import tarfile

import numpy as np
import pytest
import xxhash

from datakit import build_tar_dataset, build_token_dataset
from unbroken.data.tar.reader import ShardError, ShardIndex, ShardReader, index_tar
from unbroken.data.tokens.shard import TokenShard


def _tar(path: str, members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> str:
    with tarfile.open(path, "w", format=fmt, encoding="utf-8", errors="surrogateescape") as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def test_a_member_name_that_is_not_utf8_is_refused_by_name(tmp_path):
    """Tar names are bytes; tarfile hands a non-UTF-8 one over with surrogate escapes, which
    reached ``ShardIndex.build``'s ``encode()`` as a UnicodeEncodeError."""
    path = _tar(str(tmp_path / "s.tar"), [("ok.jpg", b"x"), ("b\udcffad.jpg", b"y" * 9)])
    with pytest.raises(ShardError) as ei:
        index_tar(path)
    msg = str(ei.value)
    assert path in msg and "UTF-8" in msg and "\\udcff" in msg, msg
    with pytest.raises(ShardError, match="UTF-8"):
        ShardReader(path)  # no index beside it: scans the tar the same way


def _lying_header(path: str, typeflag: bytes, claimed: int) -> str:
    """A GNU long-name (``L``) or PAX (``x``) header that claims ``claimed`` bytes of payload,
    followed by 512 real bytes and the end-of-archive marker."""
    ti = tarfile.TarInfo("././@LongLink" if typeflag == tarfile.GNUTYPE_LONGNAME else "pax")
    ti.type = typeflag
    ti.size = claimed
    with open(path, "wb") as f:
        f.write(ti.tobuf(tarfile.GNU_FORMAT))
        f.write(b"a.jpg".ljust(512, b"\0"))
        f.write(b"\0" * 1024)
    return path


@pytest.mark.parametrize("claimed", [1 << 33, 1 << 40, (1 << 63) - 1])
@pytest.mark.parametrize("typeflag", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE], ids=["L", "x"])
def test_a_header_size_that_lies_costs_no_memory(tmp_path, typeflag, claimed):
    """tarfile reads a long name or a PAX record with one ``read(size)`` of the size the
    header claims, and a buffered read allocates that much up front: a 1.5 kB file asked
    for up to 8 EiB (MemoryError, or gigabytes where the kernel grants them)."""
    path = _lying_header(str(tmp_path / "lie.tar"), typeflag, claimed)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ShardError) as ei:
        index_tar(path)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert path in str(ei.value), str(ei.value)
    assert grown_kib < 64 << 10, f"{grown_kib} KiB"


def _format1(tmp_path, moved: tuple[int, int, int] | None = None) -> tuple[str, str]:
    """A real 3-member shard and its format-1 index (no checksums: only its structure check
    guards it); ``moved = (j, offset, size)`` puts member j there."""
    tar = _tar(str(tmp_path / "s.tar"), [(f"k{i}.bin", bytes([65 + i]) * 700) for i in range(3)])
    idx = index_tar(tar)
    do = np.array(idx.data_offset, dtype=np.int64)
    ds = np.array(idx.data_size, dtype=np.int64)
    if moved is not None:
        j, do[j], ds[j] = moved
    raw = ShardIndex(
        idx.member_start, idx.key_off, do, ds, idx.ext_off, idx.strings, idx.tar_bytes,
        idx.tar_checksum,
    ).to_bytes()  # fmt: skip
    with open(tar + ".idx", "wb") as f:
        f.write(raw)
    return tar, tar + ".idx"


@pytest.mark.parametrize(
    "offset,size",
    [(1 << 62, 1 << 62), ((1 << 63) - 1, 1), (2048, (1 << 63) - 2048)],
    ids=["both-2**62", "offset-max", "size-max"],
)
def test_an_index_span_that_overflows_int64_is_refused(tmp_path, offset, size):
    """``data_offset + data_size > tar_bytes`` computed in int64 wraps negative for
    offset + size >= 2**63, so a member far outside the tar passed the check and an empty
    or short slice of the map was handed out as its bytes (format 1: nothing else checks)."""
    tar, idx = _format1(tmp_path, (1, offset, size))
    with pytest.raises(ShardError, match="inconsistent") as ei:
        ShardIndex.load(idx)
    assert idx in str(ei.value)
    with pytest.raises(ShardError, match="inconsistent"):
        ShardReader(tar, idx, verify=False)


def test_a_member_listed_before_the_one_it_follows_is_refused(tmp_path):
    """Sample 0's second member placed at byte 1 (inside the first header): its span ended
    before it began, and ``reader[0]`` asked ``pread`` for a negative length (OSError
    EINVAL); found by fuzzing the index words as the test below does (another seed)."""
    tar = _tar(str(tmp_path / "s.tar"), [("k0.a", b"A" * 600), ("k0.b", b"B"), ("k1.a", b"C")])
    idx = index_tar(tar)
    do = np.array(idx.data_offset, dtype=np.int64)
    ds = np.array(idx.data_size, dtype=np.int64)
    do[1], ds[1] = 1, 1
    raw = ShardIndex(
        idx.member_start, idx.key_off, do, ds, idx.ext_off, idx.strings, idx.tar_bytes,
        idx.tar_checksum, idx.member_hash,
    ).to_bytes()  # fmt: skip
    with open(tar + ".idx", "wb") as f:
        f.write(raw)
    with pytest.raises(ShardError, match="inconsistent") as ei, ShardReader(tar) as r:
        r[0]
    assert tar + ".idx" in str(ei.value)


def test_an_honest_format1_index_still_reads(tmp_path):
    tar, idx = _format1(tmp_path)
    with ShardReader(tar, idx) as r:
        assert ShardIndex.load(idx).member_hash is None
        assert [s["bin"] for s in r] == [bytes([65 + i]) * 700 for i in range(3)]


_WORDS = [0, 1, 2, 8, 255, 511, 512, 513, 1 << 31, 1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63]
_WORDS += [(1 << 64) - 1]


def _rewrite_words(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """1-3 of the index's 64-bit words (header fields and tables) set to an edge value or
    nudged, sometimes a cut, and the index's own trailing xxh3_64 recomputed - so only the
    structure checks stand in the way, as for an index crafted or written by a broken tool."""
    body = bytearray(raw[:-8])
    what = []
    for _ in range(rng.randint(1, 3)):
        off = 8 + 8 * rng.randrange((len(body) - 8) // 8)
        old = int.from_bytes(body[off : off + 8], "little")
        v = rng.choice(_WORDS) if rng.random() < 0.5 else old + rng.choice([-512, -8, -1, 1, 8])
        body[off : off + 8] = (v % (1 << 64)).to_bytes(8, "little")
        what.append(f"word at {off} = {v}")
    if rng.random() < 0.2:
        cut = rng.randrange(len(body))
        del body[cut:]
        what.append(f"cut at {cut}")
    out = bytes(body)
    return out + xxhash.xxh3_64_intdigest(out).to_bytes(8, "little"), ", ".join(what)


def test_indexes_with_valid_self_hash_but_broken_structure_fail_by_name(tmp_path):
    """1,500 seeded edits of a tar ``.idx`` and a token index that keep their own checksum
    valid: each open-and-read-everything ends in a ShardError naming the index or shard, or
    hands out members whose bytes are members of the shard (each verified against its hash)
    - never an OSError, IndexError or ValueError from inside. The sample span check came from
    here: a member listed before the previous one gave ``pread`` a negative length (EINVAL)."""
    root = build_tar_dataset(str(tmp_path / "tar"), 12, shard_size=12_000)
    tok = build_token_dataset(str(tmp_path / "tok"), 1, 3000, seq_len=8, block_tokens=256)
    tar = os.path.join(root, "shard-000000.tar")
    bin_ = os.path.join(tok, "tokens-000000.bin")
    with ShardReader(tar) as r:
        members = {bytes(v) for s in r for k, v in s.items() if k != "__key__"}
    tokens = np.fromfile(bin_, dtype="<u4")
    pristine = {p: open(p, "rb").read() for p in (tar + ".idx", bin_ + ".idx")}
    rng = random.Random(11)
    tally = {"refused": 0, "read": 0}
    for case in range(1500):
        path = rng.choice(sorted(pristine))
        raw, what = _rewrite_words(pristine[path], rng)
        with open(path, "wb") as f:
            f.write(raw)
        label = f"case {case}: {os.path.basename(path)}: {what}"
        try:
            if path.startswith(tar):
                with ShardReader(tar) as r:
                    got = [*r, *(r[i] for i in range(len(r)))]
                    got += r.read_many(np.arange(len(r))[::-1].copy())
                for s in got:
                    assert all(bytes(v) in members for k, v in s.items() if k != "__key__"), (
                        f"{label}: WRONG BYTES"
                    )
            else:
                ts = TokenShard(bin_)
                for i in range(ts.num_documents):
                    d = ts.document(i)
                    a = int(ts.offsets[i])
                    assert np.array_equal(d, tokens[a : a + len(d)]), f"{label}: WRONG TOKENS"
                for i in range(ts.num_sequences(8)):
                    assert np.array_equal(ts.sequence(i, 8), tokens[i * 8 : i * 8 + 9]), label
            tally["read"] += 1
        except ShardError as e:
            assert os.path.basename(path)[: -len(".idx")] in str(e), f"{label}: {e}"
            tally["refused"] += 1
        except Exception as e:
            raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
        finally:
            with open(path, "wb") as f:
                f.write(pristine[path])
    assert tally["refused"] > 1000 and tally["read"] > 50, tally
