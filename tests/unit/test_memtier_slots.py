"""The memory tier's slot store (issue 25 item 1: "A node-local memory tier").

Two slots per rank in a private tmpfs directory; publish writes the slot not holding the
newest complete step, header last; read takes the highest generation whose checksum
verifies. Every byte is untrusted: torn, bit-flipped, truncated and crafted slots fall back
to the other slot, then to none, never an exception or an unbounded allocation; planted
symlinks, other owners and group-writable directories are refused (T-SHARED-NODE).
"""

from __future__ import annotations

import json
import os
import random
import resource
import stat
import struct
from typing import cast

import pytest
import torch

from ckptkit import flip, small_state, train
from unbroken.ckpt import TrainState, codec, schema
from unbroken.ckpt.memtier import (
    HEADER_BYTES,
    MemorySnapshot,
    SlotStore,
    TierBusy,
    _pack,
    default_dir,
    payload_digest,
)
from unbroken.ckpt.save import encode
from unbroken.common.fs import PrivateDirError


def _state(seed: int = 0) -> TrainState:
    st, m, opt = small_state(seed)
    train(st, m, opt, 7)
    return st


def _publish(store: SlotStore, state: TrainState, step: int) -> str:
    sd, rng, tree, live = encode(state)
    meta = {
        "layouts": schema.describe(state.components, sd["components"]),
        "generators": schema.generators(state),
    }
    return store.publish(step, tree, codec.encode(rng, None), live, meta)


def _live(state: TrainState) -> dict[str, torch.Tensor]:
    return encode(state)[3]


def _same(snap_tensors: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> bool:
    return set(snap_tensors) == set(live) and all(
        torch.equal(snap_tensors[k], live[k]) for k in live
    )


@pytest.fixture
def tier(tmp_path) -> str:
    return str(tmp_path / "unbroken-test" / "job")


def test_publish_then_read_is_exact_and_alternates_slots(tier: str) -> None:
    """issue 25 item 1: a published step reads back bit-exact; publishes alternate slots,
    so the newest complete step is never the one overwritten."""
    st = _state()
    store = SlotStore(tier, rank=0)
    p1 = _publish(store, st, 1)
    p2 = _publish(store, st, 2)
    p3 = _publish(store, st, 3)
    assert p1 != p2 and p3 == p1
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is not None and snap.step == 3 and snap.generation == 3 and bad == []
    assert _same(snap.tensors, _live(st))
    sd = codec.decode(snap.tree, {k: t.clone() for k, t in snap.tensors.items()})
    assert sd["counters"]["step"] == 7
    assert snap.meta["rank"] == 0
    for p in (p1, p2):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(p1)).st_mode) == 0o700


def test_nothing_published_reads_none(tier: str) -> None:
    snap, bad = SlotStore(tier, rank=3).newest()
    assert snap is None and {b.reason for b in bad} == {"missing"}


def test_slot_in_flight_never_hides_the_last_complete_one(tier: str) -> None:
    """A publish killed after zeroing the header (or mid-payload) leaves the other slot
    as the newest: issue 25 item 1 (two slots, header written last)."""
    st = _state()
    store = SlotStore(tier, rank=0)
    _publish(store, st, 4)
    p = _publish(store, st, 5)
    with open(p, "r+b") as f:  # what a SIGKILL mid-payload of the next publish leaves
        f.write(bytes(64))
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is not None and snap.step == 4
    assert [b.reason for b in bad] == ["torn"]


@pytest.mark.parametrize("where", ["payload", "tensor", "table"])
def test_bit_flip_falls_back_to_the_other_slot_then_to_none(tier: str, where: str) -> None:
    st = _state()
    store = SlotStore(tier, rank=0)
    older = _publish(store, st, 1)
    newer = _publish(store, st, 2)
    size = os.path.getsize(newer)
    at = {"payload": HEADER_BYTES + 3, "tensor": size - 5, "table": HEADER_BYTES + 20}[where]
    flip(newer, at)
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is not None and snap.step == 1 and [b.reason for b in bad] == ["checksum"]
    flip(older, size - 9)
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is None and sorted(b.reason for b in bad) == ["checksum", "checksum"]


def test_the_payload_digest_is_a_digest_of_part_digests_and_catches_a_flip_in_any_part(
    tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slot format 2: the payload's digest is the xxh3-128 of the xxh3-128 of every
    DIGEST_PART bytes (hashed in threads; the same whatever the thread count). Parts made
    small here so the test state spans many: a flipped byte in any part, the last one's
    end included, fails the slot."""
    import xxhash

    from unbroken.ckpt import memtier

    monkeypatch.setattr(memtier, "DIGEST_PART", 4096)
    data = os.urandom(5 * 4096 + 17)
    by_hand = xxhash.xxh3_128_digest(
        b"".join(xxhash.xxh3_128_digest(data[a : a + 4096]) for a in range(0, len(data), 4096))
    )
    assert payload_digest(memoryview(data)) == by_hand
    assert payload_digest(memoryview(data[:100])) == xxhash.xxh3_128_digest(
        xxhash.xxh3_128_digest(data[:100])
    )
    st = _state()
    store = SlotStore(tier, rank=0)
    older = _publish(store, st, 1)
    newer = _publish(store, st, 2)
    size = os.path.getsize(newer)
    assert size - HEADER_BYTES > 4 * 4096  # several parts
    for at in (HEADER_BYTES + 4096 + 1, HEADER_BYTES + 2 * 4096 - 1, size - 1):
        flip(newer, at)
        snap, bad = SlotStore(tier, rank=0).newest()
        assert snap is not None and snap.step == 1 and [b.reason for b in bad] == ["checksum"]
        flip(newer, at)  # back
    snap, _ = SlotStore(tier, rank=0).newest()
    assert snap is not None and snap.step == 2 and older != newer


def test_a_format_1_slot_is_refused_by_its_version_and_the_other_slot_used(tier: str) -> None:
    """A slot a format-1 publisher left (one xxh3 stream over the payload) is not read
    as format 2: its version names it, and the restore takes the other slot or disk."""
    import struct

    import xxhash

    from unbroken.ckpt import memtier

    st = _state()
    store = SlotStore(tier, rank=0)
    _publish(store, st, 1)
    newer = _publish(store, st, 2)
    with open(newer, "rb") as f:
        raw = f.read()
    (meta_len,) = struct.unpack_from("<I", raw, 12)
    meta = raw[memtier._HEAD.size : memtier._HEAD.size + meta_len]
    payload = raw[HEADER_BYTES:]
    fields = (memtier.MAGIC, 1, meta_len, 2, 9, len(payload), xxhash.xxh3_128_digest(payload))
    body = memtier._HEAD.pack(*fields, 0)[:-8] + meta
    head = memtier._HEAD.pack(*fields, xxhash.xxh3_64_intdigest(body)) + meta
    with open(newer, "r+b") as f:
        f.write(head)
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is not None and snap.step == 1
    assert [(b.reason, "format version 1" in str(b)) for b in bad] == [("bad-header", True)]


def test_truncated_or_grown_slot_is_torn(tier: str) -> None:
    st = _state()
    store = SlotStore(tier, rank=0)
    _publish(store, st, 1)
    p = _publish(store, st, 2)
    os.truncate(p, os.path.getsize(p) - 1)
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is not None and snap.step == 1 and bad[0].reason == "torn"
    os.truncate(p, 100)  # shorter than the header
    assert cast(MemorySnapshot, SlotStore(tier, rank=0).newest()[0]).step == 1


def test_after_a_fallback_the_next_publish_keeps_the_good_slot(tier: str) -> None:
    """The writer targets the slot not holding the newest *verified* step: after the
    newest is damaged, the good older one is not overwritten."""
    st = _state()
    first = SlotStore(tier, rank=0)
    _publish(first, st, 1)
    bad = _publish(first, st, 2)
    first.close()  # the writer died
    flip(bad, os.path.getsize(bad) - 3)
    store = SlotStore(tier, rank=0)
    assert _publish(store, st, 3) == bad
    snap, _ = store.newest()
    assert snap is not None and snap.step == 3 and snap.generation == 2


def _forge(path: str, payload: bytes, *, step: int = 9, gen: int = 99, meta: bytes = b"{}") -> None:
    """A crafted slot: a correct header (checksums recomputed) over ``payload``."""
    head = _pack(step, gen, len(payload), payload_digest(memoryview(payload)), meta)
    with open(path, "wb") as f:
        f.write(head + bytes(HEADER_BYTES - len(head)) + payload)
    os.chmod(path, 0o600)


def _payload(blob: object) -> bytes:
    raw = json.dumps(blob).encode()
    return struct.pack("<Q", len(raw)) + raw


CRAFTED = {
    "table-too-long": struct.pack("<Q", 1 << 62) + b"{}",
    "not-json": struct.pack("<Q", 4) + b"{{{{",
    "deep-json": struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
    "no-table": _payload({"state": {}, "rng": None}),
    "bad-dtype": _payload({"state": {}, "rng": None, "tensors": {"a": {"dtype": "object"}}}),
    "huge-shape": _payload(
        {
            "state": {},
            "rng": None,
            "tensors": {"a": {"dtype": "float32", "shape": [1 << 40, 1 << 40], "offset": 64}},
        }
    ),  # fmt: skip
    "offset-outside": _payload(
        {
            "state": {},
            "rng": None,
            "tensors": {"a": {"dtype": "uint8", "shape": [4], "offset": 1 << 50}},
        }
    ),  # fmt: skip
    "offset-into-table": _payload(
        {"state": {}, "rng": None, "tensors": {"a": {"dtype": "uint8", "shape": [1], "offset": 0}}}
    ),
    "many-dims": _payload(
        {
            "state": {},
            "rng": None,
            "tensors": {"a": {"dtype": "uint8", "shape": [1] * 10_000, "offset": 64}},
        }
    ),  # fmt: skip
    "no-components": _payload({"state": {}, "rng": None, "tensors": {}}),
    "dangling-ref": _payload(
        {
            "state": {"counters": {}, "components": {"m": {"__ub__": "tensor", "key": "x"}}},
            "rng": None,
            "tensors": {},
        }
    ),  # fmt: skip
    "bad-rng": _payload(
        {
            "state": {
                "counters": {"step": 1, "samples": 0, "tokens": 0, "micro_step": 0},
                "components": {},
            },
            "rng": {"python": "x"},
            "tensors": {},
        }
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_payload_with_valid_checksums_is_damage(tier: str, name: str) -> None:
    """T-BOUNDED / T-FALL-BACK: a slot whose checksums are right but whose content lies
    is damage: the older slot is taken, nothing raised, nothing huge allocated."""
    st = _state()
    store = SlotStore(tier, rank=0)
    _publish(store, st, 1)
    _forge(store.slot_path(1), CRAFTED[name])
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is not None and snap.step == 1, bad
    assert len(bad) == 1 and bad[0].reason in ("bad-payload", "checksum")


@pytest.mark.parametrize(
    "field",
    ["magic", "version", "meta_len", "step", "generation", "payload_len", "meta"],
)
def test_crafted_header_fields_are_damage(tier: str, field: str) -> None:
    """Every header field is untrusted: each one out of range (with the header checksum
    recomputed, so only the field check can tell) is damage, and the other slot is used."""
    import xxhash

    st = _state()
    store = SlotStore(tier, rank=0)
    _publish(store, st, 1)
    p = _publish(store, st, 2)
    raw = bytearray(open(p, "rb").read())
    fmt = "<8sIIqqQ16sQ"
    vals = list(struct.unpack_from(fmt, raw, 0))
    idx = {"magic": 0, "version": 1, "meta_len": 2, "step": 3, "generation": 4,
           "payload_len": 5}  # fmt: skip
    bad_value = {"magic": b"XXXXXXXX", "version": 99, "meta_len": 1 << 31, "step": -1,
                 "generation": 0, "payload_len": 1 << 60}  # fmt: skip
    meta_len = vals[2]
    if field == "meta":
        junk = b"[" * 30_000
        raw[struct.calcsize(fmt) : struct.calcsize(fmt) + meta_len] = junk[:meta_len]
    else:
        vals[idx[field]] = bad_value[field]
    body = struct.pack(fmt, *vals[:-1], 0)[:-8] + bytes(
        raw[struct.calcsize(fmt) : struct.calcsize(fmt) + min(vals[2], 1 << 16)]
    )
    vals[-1] = xxhash.xxh3_64_intdigest(body)
    struct.pack_into(fmt, raw, 0, *vals)
    open(p, "wb").write(bytes(raw))
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is not None and snap.step == 1
    assert bad and bad[0].reason in ("bad-header", "torn")


def test_fuzz_random_damage_never_raises_and_bounds_memory(tier: str) -> None:
    """Seeded fuzz (issue 25 item 1): random bit flips, truncations, zeroed and appended
    ranges on the newest slot; every case that changed a byte yields the older slot
    bit-exact (every byte of a slot is checked), never an exception; peak RSS stays flat."""
    rng = random.Random(25)
    st = _state()
    store = SlotStore(tier, rank=0)
    _publish(store, st, 1)
    good = _publish(store, st, 2)
    pristine = open(good, "rb").read()
    live = _live(st)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for case in range(300):
        raw = bytearray(pristine)
        kind = rng.choice(["flip", "truncate", "zero", "append", "header-flip"])
        if kind == "flip":
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif kind == "header-flip":
            raw[rng.randrange(64)] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            del raw[rng.randrange(len(raw)) :]
        elif kind == "zero":
            a = rng.randrange(len(raw))
            raw[a : a + rng.randrange(1, 4096)] = bytes(len(raw[a : a + 4096]))
        else:
            raw += os.urandom(rng.randrange(1, 100))
        with open(good, "wb") as f:
            f.write(raw)
        snap, _ = SlotStore(tier, rank=0).newest()
        assert snap is not None, f"case {case} ({kind}): the intact older slot was not found"
        assert snap.step in (1, 2) and _same(snap.tensors, live), f"case {case} ({kind})"
        if bytes(raw) != pristine:
            assert snap.step == 1, f"case {case} ({kind}) took a damaged slot"
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown_mib < 64, f"peak RSS grew {grown_mib:.0f} MiB over the fuzz"


def test_planted_symlink_in_place_of_the_rank_directory_is_refused(tmp_path) -> None:
    """T-SHARED-NODE: another user's symlink where our directory should be is refused."""
    tier = tmp_path / "job"
    tier.mkdir(mode=0o700)
    target = tmp_path / "theirs"
    target.mkdir()
    (tier / "rank-0").symlink_to(target)
    with pytest.raises(
        PrivateDirError, match="rank-0: the memory-tier rank directory is a symlink"
    ):
        SlotStore(str(tier), rank=0)


def test_planted_symlink_slot_is_never_followed(tier: str, tmp_path) -> None:
    store = SlotStore(tier, rank=0)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, store.slot_path(0))
    snap, bad = store.newest()
    assert snap is None and "unreadable" in {b.reason for b in bad}
    with pytest.raises(PrivateDirError, match="symlink in place of a memory-tier slot"):
        _publish(store, _state(), 1)
    assert victim.read_bytes() == b"precious"


def test_group_writable_directory_is_refused(tmp_path) -> None:
    tier = tmp_path / "job"
    tier.mkdir()
    os.chmod(tier, 0o770)
    with pytest.raises(PrivateDirError, match=r"memory-tier directory .*mode 0770.*chmod go-w"):
        SlotStore(str(tier), rank=0)


def test_group_writable_user_directory_of_the_default_layout_is_refused(tmp_path) -> None:
    user = tmp_path / "unbroken-0"
    user.mkdir()
    os.chmod(user, 0o777)
    with pytest.raises(PrivateDirError, match="unbroken-0: the memory-tier directory"):
        SlotStore(str(user / "job"), rank=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_directory_of_another_user_is_refused(tmp_path) -> None:
    tier = tmp_path / "job"
    tier.mkdir(mode=0o700)
    os.chown(tier, 65534, 65534)
    with pytest.raises(PrivateDirError, match="owned by uid 65534"):
        SlotStore(str(tier), rank=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_slot_file_of_another_user_is_not_read(tier: str) -> None:
    store = SlotStore(tier, rank=0)
    _publish(store, _state(), 1)
    os.chown(store.slot_path(0), 65534, 65534)
    snap, bad = SlotStore(tier, rank=0).newest()
    assert snap is None and bad[0].reason == "unreadable" and "uid 65534" in bad[0].detail


def test_second_live_publisher_is_refused(tier: str) -> None:
    st = _state()
    first = SlotStore(tier, rank=0)
    _publish(first, st, 1)
    with pytest.raises(TierBusy, match="another live process publishes"):
        _publish(SlotStore(tier, rank=0), st, 2)
    first.close()
    _publish(SlotStore(tier, rank=0), st, 2)


def test_default_dir_is_per_user_and_per_root(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("UNBROKEN_MEMORY_TIER", raising=False)
    a, b = default_dir(str(tmp_path / "a")), default_dir(str(tmp_path / "b"))
    assert a != b and a.startswith(f"/dev/shm/unbroken-{os.geteuid()}/")
    monkeypatch.setenv("UNBROKEN_MEMORY_TIER", str(tmp_path / "x"))
    assert default_dir(str(tmp_path / "a")) == str(tmp_path / "x")


def test_bfloat16_and_empty_tensors_round_trip(tier: str) -> None:
    store = SlotStore(tier, rank=0)
    tensors = {
        "a": torch.randn(5, 3).to(torch.bfloat16),
        "b": torch.empty(0, 4),
        "c": torch.arange(7, dtype=torch.int64)[::2],  # not contiguous
    }
    tree = {
        "counters": {"step": 1, "samples": 0, "tokens": 0, "micro_step": 0},
        "components": {"x": {k: {"__ub__": "tensor", "key": k} for k in tensors}},
    }
    store.publish(1, tree, None, tensors)
    snap, bad = store.newest()
    assert snap is not None, bad
    assert all(torch.equal(snap.tensors[k], t) for k, t in tensors.items())


def test_a_shorter_meta_over_a_longer_one_still_verifies(tier: str) -> None:
    """issue 25 item 2 (found by the one-line test): a slot rewritten with a shorter header
    meta than its last one must leave no stale byte in the header area (which a reader
    refuses as damage): the whole area is rewritten."""
    st = _state()
    store = SlotStore(tier, rank=0)
    sd, rng, tree, live = encode(st)
    enc = codec.encode(rng, None)
    store.publish(1, tree, enc, live, {"pad": "x" * 500})
    store.publish(2, tree, enc, live, {"pad": "x" * 500})
    store.publish(3, tree, enc, live, {"pad": "x"})  # into slot 0, over step 1's long meta
    snap, bad = store.newest()
    assert snap is not None and snap.step == 3 and not bad, bad


def test_reused_json_parts_never_change_a_value(tier: str) -> None:
    """issue 25 item 3: the publish reuses the JSON of parts that did not change; a value
    that compares equal but is another JSON value (1 == True == 1.0, 0.0 == -0.0) is
    encoded afresh, and a changed RNG stream too: what a slot reads back is what was
    published, publish after publish."""
    st = _state()
    store = SlotStore(tier, rank=0)
    sd, rng, tree, live = encode(st)
    enc = codec.encode(rng, None)
    seen = []
    for step, v in enumerate([1, True, 1.0, 0.0, -0.0, [1, 2], [True, 2]], start=1):
        t = {**tree, "components": {**tree["components"], "x": {"v": v, "refs": "same"}}}
        py = random.Random(step).getstate()  # a stream that moved
        r = {**enc, "python": codec.encode(py, None)}
        store.publish(step, t, r, live)
        snap, bad = store.newest()
        assert snap is not None and snap.step == step, bad
        got = snap.tree["components"]["x"]["v"]
        assert json.dumps(got) == json.dumps(v), (step, got, v)
        assert snap.rng["python"] == py
        seen.append(got)
        del snap
    assert [type(x) for x in seen] == [int, bool, float, float, float, list, list]


def test_encode_fast_path_is_the_same_encoding() -> None:
    """issue 25 item 3: a list or tuple of plain scalars is encoded without a walk, to the
    same JSON as before; anything else in it (a tensor, a numpy scalar) takes the walk."""
    import numpy as np

    tensors: dict[str, torch.Tensor] = {}
    obj = {
        "a": [1, 2.5, "x", None, True],
        "b": (1, 2),
        "c": [np.float32(1.5), 2],
        "d": [torch.ones(2)],
    }
    tree = codec.encode(obj, tensors)
    assert tree["a"] == [1, 2.5, "x", None, True] and tree["a"] is not obj["a"]
    assert tree["b"] == {"__ub__": "tuple", "items": [1, 2]}
    assert tree["c"][0]["__ub__"] == "npscalar" and tree["d"] == [
        {"__ub__": "tensor", "key": "d/0"}
    ]
    # a mapping of plain tensors (a module's state dict) is one loop: the same references
    flat = {"w": torch.ones(1), "a/b": torch.zeros(2)}
    got: dict[str, torch.Tensor] = {}
    assert codec.encode({"m": flat}, got) == {
        "m": {
            "w": {"__ub__": "tensor", "key": "m/w"},
            "a/b": {"__ub__": "tensor", "key": "m/a%2Fb"},
        }
    }
    assert got["m/w"] is flat["w"] and got["m/a%2Fb"] is flat["a/b"]
    back = codec.decode(json.loads(json.dumps(tree)), tensors)
    assert back["a"] == obj["a"] and back["b"] == (1, 2) and type(back["c"][0]) is np.float32


def test_a_publish_in_flight_never_hides_the_last_complete_slot(tmp_path) -> None:
    """issue 25 speed item 3: a publish is begin() (the copy, in the loop) and finish()
    (checksum and header, in the tier's thread). Between the two the slot being written is
    torn and the other one is the newest complete; a second begin() is refused; the slot
    becomes complete in finish(), which calls ``on_complete`` once, and the next publish
    goes into the other slot."""
    st = _state()
    sd, rng, tree, live = encode(st)
    enc = codec.encode(rng, None)
    store = SlotStore(str(tmp_path / "job"), rank=0)
    done: list[tuple[str, int, int]] = []
    store.on_complete = lambda path, step, gen: done.append((os.path.basename(path), step, gen))
    store.publish(1, tree, enc, live)
    assert done == [("slot-0", 1, 1)]
    p = store.begin(2, tree, enc, live)
    assert p.slot == 1 and done == [("slot-0", 1, 1)]
    reader = SlotStore(str(tmp_path / "job"), rank=0)
    snap, bad = reader.newest()
    assert snap is not None and snap.step == 1 and [b.reason for b in bad] == ["torn"]
    with pytest.raises(RuntimeError, match="not finished"):
        store.begin(3, tree, enc, live)
    assert store.finish(p).endswith("slot-1")
    assert done[-1] == ("slot-1", 2, 2)
    snap, bad = reader.newest()
    assert snap is not None and snap.step == 2 and not bad
    assert store.begin(3, tree, enc, live).slot == 0  # over step 1, never over step 2
    store.close()
