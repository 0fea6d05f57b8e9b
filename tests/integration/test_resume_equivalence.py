"""Resume equivalence (D-ORDER, D-RESUME): one reusable harness, parameterized by dataset kind,
world size, worker count, batch size, last-batch policy and interrupt point.

Every case: run an uninterrupted reference for two epochs; run layout A up to an interrupt
point, take the state dict (JSON round trip), resume with layout B in fresh loaders, run to the
end. The global sequence (every rank's batches interleaved back into global positions) of A's
part followed by B's part must equal the reference exactly - so no sample is missing and none
is repeated - and each reference epoch must be a permutation of the dataset.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from datakit import ids_collate
from rankkit import group_file, join_group
from unbroken.data.stream.dataset import Source, StreamingDataset
from unbroken.data.stream.loader import StatefulLoader
from unbroken.data.stream.order import Partition

# num_workers=3 on a 2-core runner is deliberate (worker-count changes)
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
EPOCHS = 2
SEED = 11
WINDOW = 24  # several shuffle windows per epoch (the default would shuffle these globally)


@dataclass(frozen=True)
class Layout:
    world: int
    workers: int
    batch: int

    def __str__(self) -> str:
        return f"W{self.world}-n{self.workers}-b{self.batch}"


def _spec(kind: str, data: Callable[[str], str]) -> Any:
    if kind == "mix":
        return [Source(data("tar"), 0.7), Source(data("tar_b"), 0.3)]
    return data(kind)


def _loaders(spec: Any, lay: Layout, policy: str) -> list[StatefulLoader]:
    return [
        StatefulLoader(
            StreamingDataset(spec, seed=SEED, shuffle_window=WINDOW, rank=r, world_size=lay.world),
            batch_size=lay.batch,
            collate_fn=ids_collate,
            num_workers=lay.workers,
            last_batch=policy,
        )
        for r in range(lay.world)
    ]


def _interleave(batches: list[list[str] | None]) -> list[str]:
    """Rank r's j-th sample sits at global offset j*world + r of its step."""
    got = [b or [] for b in batches]
    return [b[j] for j in range(max(map(len, got))) for b in got if j < len(b)]


def run(
    spec: Any,
    lay: Layout,
    policy: str,
    *,
    state: dict[str, Any] | None = None,
    stop_after: int | None = None,
) -> tuple[list[list[str]], dict[str, Any]]:
    """Ranks in lockstep until EPOCHS epochs are done or ``stop_after`` global steps;
    returns the global steps and the (rank-independent) state at the stop."""
    loaders = _loaders(spec, lay, policy)
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(json.loads(json.dumps(state)))
    steps: list[list[str]] = []
    while loaders[0].epoch < EPOCHS:
        its = [iter(ld) for ld in loaders]
        try:
            while True:
                if stop_after is not None and len(steps) == stop_after:
                    states = [ld.state_dict() for ld in loaders]
                    assert all(s == states[0] for s in states), states
                    return steps, states[0]
                batches = [next(it, None) for it in its]
                if all(b is None for b in batches):
                    break
                steps.append(_interleave(batches))
        finally:
            for it in its:
                it.close()  # type: ignore[attr-defined]
    return steps, loaders[0].state_dict()


def _cut(name: str, n: int, lay: Layout, policy: str) -> int:
    """Global step index of a named interrupt point."""
    per_epoch = Partition(0, n, lay.batch, 0, lay.world, policy).num_steps
    return {
        "first": 1,
        "mid": per_epoch // 2,
        "before_end": per_epoch - 1,  # the last batch of epoch 0 not yet delivered
        "at_end": per_epoch,  # all of epoch 0 delivered: state is (epoch 1, 0)
        "after_start": per_epoch + 1,  # one step into epoch 1
    }[name]


def check_resume(
    data: Callable[[str], str], kind: str, a: Layout, b: Layout, cut: str, policy: str
) -> None:
    spec = _spec(kind, data)
    n = StreamingDataset(spec, seed=SEED).epoch_length
    ref, end_state = run(spec, a, policy)
    assert end_state["epoch"] == EPOCHS and end_state["samples_consumed"] == 0
    k = _cut(cut, n, a, policy)
    first, state = run(spec, a, policy, stop_after=k)
    assert first == ref[:k]
    second, _ = run(spec, b, policy, state=state)
    seen = [x for s in first + second for x in s]
    want = [x for s in ref for x in s]
    missing = set(want) - set(seen)
    assert not missing, f"missing after resume: {sorted(missing)[:10]}"
    assert len(seen) == len(want), f"{len(seen) - len(want)} duplicated samples"
    assert seen == want, "resumed sequence differs from the uninterrupted one"
    if kind != "mix" and policy == "short":
        per = len(want) // EPOCHS
        for e in range(EPOCHS):
            epoch = want[e * per : (e + 1) * per]
            assert len(set(epoch)) == len(epoch) == n  # each epoch: a permutation


CASES = [
    # world size changes (explicit rank/world_size in one process), every interrupt point
    *[
        ("tar", Layout(1, 0, 4), Layout(2, 0, 4), c, "short")
        for c in ("mid", "before_end", "at_end", "after_start")
    ],
    *[
        ("tar", Layout(2, 0, 3), Layout(3, 0, 3), c, "short")
        for c in ("first", "before_end", "at_end")
    ],
    *[
        ("tar", Layout(4, 0, 2), Layout(1, 0, 5), c, "short")
        for c in ("mid", "before_end", "after_start")
    ],
    # worker count changes (real DataLoader worker processes)
    ("tar", Layout(1, 0, 8), Layout(1, 2, 8), "before_end", "short"),
    ("tokens", Layout(1, 2, 4), Layout(1, 3, 4), "mid", "short"),
    ("mix", Layout(1, 3, 4), Layout(1, 0, 6), "at_end", "short"),
    ("tokens", Layout(2, 2, 3), Layout(1, 0, 4), "after_start", "short"),
    ("mix", Layout(2, 0, 5), Layout(3, 0, 2), "before_end", "short"),
    # pad / drop keep ranks in lockstep; same global batch on both sides
    ("tar", Layout(2, 0, 4), Layout(2, 2, 4), "before_end", "pad"),
    ("tar", Layout(2, 2, 4), Layout(2, 0, 4), "after_start", "drop"),
    ("tokens", Layout(3, 0, 2), Layout(1, 0, 6), "mid", "pad"),
]


@pytest.mark.parametrize(
    "kind,a,b,cut,policy", CASES, ids=[f"{c[0]}-{c[1]}->{c[2]}-{c[3]}-{c[4]}" for c in CASES]
)
def test_resume_equivalence(stream_data, kind, a, b, cut, policy):
    check_resume(stream_data, kind, a, b, cut, policy)


@pytest.mark.parametrize("kind", ["tar", "tokens", "mix"])
def test_global_sequence_is_independent_of_layout(stream_data, kind):
    spec = _spec(kind, stream_data)
    ref, _ = run(spec, Layout(1, 0, 7), "short")
    flat = [x for s in ref for x in s]
    for lay in (Layout(3, 0, 2), Layout(2, 2, 5), Layout(1, 3, 1)):
        got, _ = run(spec, lay, "short")
        assert [x for s in got for x in s] == flat, lay


# --- real processes: gloo, ranks from torch.distributed ---------------------------------


def _rank_main(
    rank: int,
    world: int,
    rdzv: str,
    spec: Any,
    batch: int,
    stop: int | None,
    state_path: str,
    out: str,
) -> None:
    import torch.distributed as dist

    join_group(rank, world, rdzv)
    try:
        # rank and world size from torch.distributed
        ds = StreamingDataset(spec, seed=SEED, shuffle_window=WINDOW)
        assert (ds.rank, ds.world_size) == (rank, world)
        ld = StatefulLoader(
            ds, batch_size=batch, collate_fn=ids_collate, num_workers=1, last_batch="short"
        )
        if os.path.exists(state_path):
            with open(state_path) as f:
                ld.load_state_dict(json.load(f))
        batches: list[list[str]] = []
        while ld.epoch < EPOCHS and (stop is None or len(batches) < stop):
            for bt in ld:
                batches.append(bt)
                if stop is not None and len(batches) == stop:
                    break
        dist.barrier()  # a checkpoint is taken at a step boundary every rank has reached
        with open(out, "w") as f:
            json.dump({"batches": batches, "state": ld.state_dict()}, f)
    finally:
        dist.destroy_process_group()


def _launch(
    world: int, spec: Any, batch: int, stop: int | None, state_path: str, tmp: str, tag: str
) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    rdzv = group_file(tmp)
    outs = [os.path.join(tmp, f"{tag}-{r}.json") for r in range(world)]
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world, rdzv, spec, batch, stop, state_path, outs[r])
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    res = []
    for o in outs:
        with open(o) as f:
            res.append(json.load(f))
    return res


def test_resume_across_real_gloo_processes_world_2_to_3(stream_data, tmp_path):
    spec = stream_data("tar")
    ref, _ = run(spec, Layout(2, 0, 4), "short")
    state_path = str(tmp_path / "state.json")
    a = _launch(2, spec, 4, 9, state_path, str(tmp_path), "a")
    assert a[0]["state"] == a[1]["state"]  # every rank holds the same, layout-free state
    with open(state_path, "w") as f:
        json.dump(a[0]["state"], f)
    b = _launch(3, spec, 3, None, state_path, str(tmp_path), "b")
    first = [_interleave([r["batches"][s] for r in a]) for s in range(9)]
    steps_b = max(len(r["batches"]) for r in b)
    second = [
        _interleave([r["batches"][s] if s < len(r["batches"]) else None for r in b])
        for s in range(steps_b)
    ]
    assert first == ref[:9]
    assert [x for s in first + second for x in s] == [x for s in ref for x in s]
