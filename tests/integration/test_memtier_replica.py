"""The memory tier's peer replica with two real gloo ranks as two "nodes" (issue 25 peer
replica; C-TIERS, T-FALL-BACK, T-SHARED-NODE).

Each rank gets its own memory directory (its node's ``/dev/shm``) and ``jump = 1`` (one rank
per node), so rank 0 keeps ``replica-of-1`` and rank 1 keeps ``replica-of-0``. Phase 1: two
spawned ranks train 7 steps with ``memory_every_steps=1, every_steps=5`` and exit without
closing (a crash). Then node B (rank 1) is lost: its directory is removed. Phase 2: two fresh
ranks restore: rank 1 gets its step 7 from rank 0's replica of it ("peer replica"), bit-exact.
A replica planted, symlinked, truncated or bit-flipped is never loaded: both ranks take the
disk tier's step 5 and the restore line says why.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from ckptkit import Pristine, flip, report_and_exit, spawn_two
from rankkit import group_file, join_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _PerRank:
    def __init__(self, v: float) -> None:
        self.v = torch.tensor([v])

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.v}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.v = sd["v"].clone()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _worker(rank: int, world: int, job: dict[str, Any]) -> None:
    from unbroken.ckpt import Checkpointer, TrainState

    # one rank per "node", each node its own memory directory
    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    lines = _Lines()
    logging.getLogger("unbroken").addHandler(lines)
    logging.getLogger("unbroken").setLevel(logging.INFO)
    join_group(rank, world, job["rdzv"])
    torch.manual_seed(0 if job["mode"] == "train" else 99)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mine = _PerRank(-1.0)
    st = TrainState(model=model, optimizer=opt, extras={"mine": mine}, seed=1)
    tier = job.get(f"{job['mode']}_tiers", job["tiers"])[rank]
    ck = Checkpointer(job["root"], st, every_steps=5, memory_every_steps=1, memory_dir=tier)
    out: dict[Any, Any] = {}
    if job["mode"] == "train":
        assert ck.restore() is None
        for step in range(1, job.get("steps", 7) + 1):
            model(torch.ones(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mine.v = torch.tensor([rank * 100.0 + step])
            st.step = step
            ck.maybe_save()
            ck.wait()
            out[step] = [float(model.weight.detach().sum()), float(mine.v)]
            replica = ck._memory.replica  # type: ignore[union-attr]
            if step == job.get("keep_at") and replica.drain(120):  # a copy of that replica
                shutil.copyfile(replica.path, replica.path + ".kept")
        replica = ck._memory.replica  # type: ignore[union-attr]
        assert replica is not None and replica.drain(120), replica and replica.stopped
        out["replica"] = replica.received
    elif job["mode"] == "rollback":  # an older step restored on purpose, one step on, saved
        assert ck.restore(job["rollback_to"]) == job["rollback_to"]
        # the crash below comes before the new step's replica round has run
        ck._memory.replica._stop("the test's crash comes first")  # type: ignore[union-attr]
        model(torch.ones(2, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mine.v = torch.tensor([rank * 100.0 + 50])
        st.step += 1
        ck.save()
        ck.wait()
        out = {"state": [float(model.weight.detach().sum()), float(mine.v)]}
    else:
        got = ck.restore()
        out = {"step": got, "tier": ck.restored_tier, "lines": lines.lines}
        out["state"] = [float(model.weight.sum()), float(mine.v)]
    report_and_exit(job, rank, out)


def _run(job: dict[str, Any]) -> None:
    spawn_two(_worker, job)


def _result(out: str, mode: str, r: int) -> dict[str, Any]:
    with open(os.path.join(out, f"{mode}-{r}.json")) as f:
        return json.load(f)


def _job(base: str, **more: Any) -> dict[str, Any]:
    """The checkpoint root, the two nodes' memory directories and the output, under ``base``."""
    tiers = [os.path.join(base, f"unbroken-{n}", "job") for n in "AB"]
    return {"root": os.path.join(base, "ckpt"), "tiers": tiers, "out": base, **more}


def _train(tmp_path, steps: int, **more: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job = _job(str(tmp_path), steps=steps, **more)
    _run({**job, "mode": "train"})
    return job, [_result(str(tmp_path), "train", r) for r in range(2)]


@pytest.fixture(scope="module")
def seven(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    """Phase 1 (7 steps), once for the module; each test below gets it back untouched."""
    base = tmp_path_factory.mktemp("seven")
    _train(base, 7)
    return Pristine(str(base))


def _seven(seven: Pristine) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The 7-step run as phase 1 left it: (job, each rank's training record)."""
    base = seven.fresh()
    return _job(base, steps=7), [_result(base, "train", r) for r in range(2)]


def test_node_loss_restores_from_the_peer_replica(seven) -> None:
    """issue 25 peer replica item 1 and 2: each rank's newest slot is kept by the rank on
    the other node (0600 in its 0700 directory); when node B's memory is lost, its fresh
    rank gets step 7 from node A's replica, bit-exact, and the restore line names the tier."""
    job, trained = _seven(seven)
    tier_a, tier_b = job["tiers"]
    assert trained[0]["replica"] == 7 and trained[1]["replica"] == 7, trained
    for tier, src in ((tier_a, 1), (tier_b, 0)):
        info = os.lstat(os.path.join(tier, f"replica-of-{src}"))
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(tier).st_mode) == 0o700
    shutil.rmtree(os.path.dirname(tier_b))  # node B is lost with its /dev/shm
    _run({**job, "mode": "load"})
    for r in range(2):
        got = _result(job["out"], "load", r)
        assert (got["step"], got["tier"]) == (7, "peer replica"), (r, got)
        assert got["state"] == trained[r]["7"], (r, got, trained[r])
    line = [x for x in _result(job["out"], "load", 0)["lines"] if "resumed from step" in x]
    assert line and "from the peer replica tier" in line[0], line
    assert "memory tier missing on rank(s) [1]" in line[0], line
    # rank 1 keeps its state in its own memory tier again
    assert os.path.exists(os.path.join(tier_b, "rank-1", "slot-0"))


def test_node_loss_with_ranks_renumbered_restores_from_the_copies_on_the_other_node(
    seven, tmp_path
) -> None:
    """issue 25 peer replica item 2: the new rendezvous numbers the nodes differently: the
    surviving node A now runs rank 1 and the replacement node (empty memory) rank 0. Node A
    holds both states: rank 1's in its replica (copied into rank 1's slots on the node) and
    rank 0's in the old rank-0 slots (sent to the new node). Both resume at step 7."""
    job, trained = _seven(seven)
    tier_a, tier_b = job["tiers"]
    shutil.rmtree(os.path.dirname(tier_b))
    fresh = str(tmp_path / "unbroken-C" / "job")
    _run({**job, "mode": "load", "load_tiers": [fresh, tier_a]})
    for r in range(2):
        got = _result(job["out"], "load", r)
        assert (got["step"], got["tier"]) == (7, "peer replica"), (r, got)
        assert got["state"] == trained[r]["7"], (r, got, trained[r])


@pytest.mark.parametrize("attack", ["planted", "symlink", "truncated", "flip"])
def test_a_damaged_or_planted_replica_falls_back_to_disk(seven, tmp_path, attack: str) -> None:
    """issue 25 peer replica item 2 (security): the replica of the lost rank is attacked on
    the surviving node: a planted file, a symlink to a valid copy, a truncated file, a bit
    flip in the payload. It is never loaded: both ranks restore disk step 5, bit-exact, and
    the restore line says why the newer memory steps were skipped."""
    job, trained = _seven(seven)
    tier_a, tier_b = job["tiers"]
    shutil.rmtree(os.path.dirname(tier_b))
    target = os.path.join(tier_a, "replica-of-1")
    size = os.path.getsize(target)
    if attack == "planted":
        with open(target, "wb") as f:
            f.write(os.urandom(size))
    elif attack == "symlink":
        copy = str(tmp_path / "valid-copy")
        shutil.copyfile(target, copy)
        os.chmod(copy, 0o600)
        os.unlink(target)
        os.symlink(copy, target)
    elif attack == "truncated":
        os.truncate(target, size // 2)
    else:
        flip(target, size - 5)
    _run({**job, "mode": "load"})
    for r in range(2):
        got = _result(job["out"], "load", r)
        assert (got["step"], got["tier"]) == (5, "disk"), (r, attack, got)
        assert got["state"] == trained[r]["5"], (r, got, trained[r])
    line = [x for x in _result(job["out"], "load", 0)["lines"] if "resumed from step" in x]
    assert line and "memory tier not used" in line[0], line
    if attack == "flip":
        assert "peer replica of rank 1 (step 7) is damaged" in line[0], line
        assert "checksum" in line[0], line
    else:
        assert "memory step 7 is missing on rank(s) [1]" in line[0], line


def test_a_replica_older_than_the_disk_tier_is_not_used(tmp_path) -> None:
    """issue 25 peer replica item 2: node B is lost just after the disk save of step 5,
    while step 5's replica was in flight: node A keeps step 4 of B's rank (its slots hold
    4 and 5). The disk tier restores step 5, and the line says the peer replica was older."""
    job, trained = _train(tmp_path, steps=5, keep_at=4)
    assert trained[0]["replica"] == 5, trained
    target = os.path.join(job["tiers"][0], "replica-of-1")
    os.replace(target + ".kept", target)  # step 5's transfer never arrived
    shutil.rmtree(os.path.dirname(job["tiers"][1]))
    _run({**job, "mode": "load"})
    for r in range(2):
        got = _result(job["out"], "load", r)
        assert (got["step"], got["tier"]) == (5, "disk"), (r, got)
        assert got["state"] == trained[r]["5"], (r, got, trained[r])
    line = [x for x in _result(job["out"], "load", 0)["lines"] if "resumed from step" in x]
    assert line and "peer replica step 4 is older than disk step 5" in line[0], line


def test_a_rollback_leaves_no_replica_of_the_abandoned_run_to_resume(tmp_path) -> None:
    """``restore(5)`` on purpose after steps 6-8 were published and replicated on the other
    node; one step on, saved as the new trajectory's 6 (disk and memory); then a crash
    before 6's replica round ran. The own slots of 7 and 8 were invalidated at that save,
    but each node's replica still held step 8 of the abandoned run, and the restart took it
    from the peers over everyone's new 6: the replicas newer than the step rolled back to
    must go at the same save."""
    job, trained = _train(tmp_path, steps=8)
    assert trained[0]["replica"] == 8 and trained[1]["replica"] == 8, trained
    _run({**job, "mode": "rollback", "rollback_to": 5})
    _run({**job, "mode": "load"})
    for r in range(2):
        got, want = _result(job["out"], "load", r), _result(job["out"], "rollback", r)
        assert (got["step"], got["tier"]) == (6, "memory"), (r, got)
        assert got["state"] == want["state"], (r, got, want)


def _gone_worker(rank: int, world: int, job: dict[str, Any]) -> None:
    from unbroken.ckpt import Checkpointer, TrainState

    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    lines = _Lines()
    logging.getLogger("unbroken").addHandler(lines)
    join_group(rank, world, job["rdzv"])
    model = torch.nn.Linear(4, 3)
    st = TrainState(model=model, seed=1)
    tier = job["tiers"][rank]
    ck = Checkpointer(job["root"], st, memory_every_steps=1, memory_dir=tier)
    replica = ck._memory.replica  # type: ignore[union-attr]
    for step in range(1, 4):
        st.step = step
        ck.maybe_save()
    assert replica.drain(120), replica.stopped
    dist.barrier()
    if rank == 1:
        os._exit(0)  # the peer's node is gone
    for step in range(4, 30):  # rank 0 trains on: its publishes never wait for the peer
        with torch.no_grad():
            model.weight.add_(1.0)
        st.step = step
        ck.maybe_save()
    stopped = replica.drain(120)
    out = {
        "stopped": replica.stopped,
        "drained": stopped,
        "published": ck._memory.published,  # type: ignore[union-attr]
        "warnings": [x for x in lines.lines if "peer replica off" in x],
    }
    with open(os.path.join(job["out"], "gone-0.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)


def test_when_the_peer_is_gone_the_sender_logs_once_and_stops(tmp_path) -> None:
    """issue 25 peer replica item 1: rank 1's process (its node) is gone; rank 0 keeps
    training and publishing to its own memory tier, its replica thread logs one WARNING and
    stops replicating (until the next rendezvous: a new process)."""
    job = _job(str(tmp_path))
    job["rdzv"] = group_file(job["out"])
    ctx = tmp_mp.start_processes(
        _gone_worker, args=(2, job), nprocs=2, start_method="spawn", join=False
    )
    while not ctx.join(timeout=5):
        pass
    with open(os.path.join(str(tmp_path), "gone-0.json")) as f:
        got = json.load(f)
    assert got["published"] == 29, got
    assert got["stopped"] and got["drained"], got
    assert len(got["warnings"]) == 1, got
