"""Multi-rank checkpoints with real gloo process groups (ranks forked, see ``_start_ranks``).

* re-sharding matrix (C-RESHARD): saved on 1, 2, 4 ranks; loaded on 1, 2, 3, 4 ranks —
  replicated model + AdamW state, a DTensor sharded over all ranks, the data loader's
  position; tensors equal, training continues, no sample missing or repeated;
* collective fall-back: one rank's file of the newest checkpoint is corrupted -> every rank
  loads the previous step.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from rankkit import group_file, join_group

pytestmark = pytest.mark.slow

# What the ranks import, imported once here, before they fork (``_start_ranks``).
for _name in (
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.nn.parallel",
    "unbroken.ckpt",
    "unbroken.ckpt.export",
    "unbroken.data.stream.loader",
):
    importlib.import_module(_name)

BATCH = 2
N_SAMPLES = 96


class _Sharded:
    """A DTensor sharded over every rank (as FSDP2 parameters are)."""

    def __init__(self, t: Any) -> None:
        self.t = t

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = sd["t"]


def _build(data_root: str, world: int) -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from unbroken.ckpt import TrainState
    from unbroken.data.stream.dataset import StreamingDataset
    from unbroken.data.stream.loader import StatefulLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)
    sharded = _Sharded(distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]))
    loader = StatefulLoader(
        StreamingDataset(data_root, seed=3), batch_size=BATCH, last_batch="drop"
    )
    st = TrainState(model=model, optimizer=opt, loader=loader, extras={"sharded": sharded}, seed=7)
    return st, model, opt, sharded, loader, full, mesh


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.linspace(-1, 1, 32).reshape(4, 8)  # same on every rank: replicas stay equal
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _worker(rank: int, world: int, job: dict[str, Any]) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from unbroken.ckpt import Checkpointer

    join_group(rank, world, job["rdzv"])
    try:
        out: dict[str, Any] = {}
        step: int | None
        for root in job["roots"]:
            st, model, opt, sharded, loader, full, mesh = _build(job["data"], world)
            ck = Checkpointer(root, st, keep_last=None)
            if job["mode"] == "save":
                sharded.t = distribute_tensor(full, mesh, [Shard(0)])
                it = iter(loader)
                keys = []
                for step in range(1, job["steps"] + 1):
                    keys += list(next(it)["__key__"])
                    _train_step(model, opt)
                    st.step = step
                    ck.save()
                out[root] = {"keys": keys}
                if rank == 0:
                    torch.save(
                        {k: v.clone() for k, v in model.state_dict().items()},
                        os.path.join(root, "expected.pt"),
                    )
            else:
                step = ck.restore()
                expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
                ok_model = all(torch.equal(expected[k], v) for k, v in model.state_dict().items())
                ok_shard = torch.equal(sharded.t.full_tensor(), full)
                ok_opt = len(opt.state) == 4 and int(opt.state_dict()["state"][0]["step"]) == step
                keys = [k for batch in loader for k in batch["__key__"]]
                _train_step(model, opt)  # training continues
                out[root] = {
                    "step": step,
                    "keys": keys,
                    "model": ok_model,
                    "shard": ok_shard,
                    "opt": ok_opt,
                }
            ck.close()
        with open(os.path.join(job["out"], f"{job['mode']}-w{world}-r{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _rank(rank: int, fn: Any, world: int, job: dict[str, Any]) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    fn(rank, world, job)


def _start_ranks(fn: Any, world: int, job: dict[str, Any], method: str = "fork") -> None:
    """``fn(rank, world, job)`` in ``world`` processes, joined; raises if one failed.

    Forked by default, not spawned: a spawned rank is a fresh interpreter that imports torch,
    DCP and unbroken again (~5 CPU-s each, 35 ranks in this file), and what these tests prove
    (the checkpoint each rank writes and reads over a real gloo group) does not need one.
    What only separate interpreters show stays covered: ranks whose str hashes differ (a set
    iterated in another order on another rank before a collective) by the collective
    fall-back test below (``method="spawn"``) and the torchrun tests (tests/drill); the
    ranks' exit through interpreter shutdown (gloo threads) by test_ckpt_preempt_ranks.py."""
    here = job.get("out") or os.path.dirname(job["root"])  # the test's tmp dir
    job = {**job, "rdzv": group_file(here)}
    tmp_mp.start_processes(
        _rank, args=(fn, world, job), nprocs=world, start_method=method, join=True
    )


def _run(world: int, job: dict[str, Any], fn: Any = None, method: str = "fork") -> None:
    _start_ranks(fn or _worker, world, job, method)


def _results(out: str, mode: str, world: int) -> list[dict[str, Any]]:
    return [json.load(open(os.path.join(out, f"{mode}-w{world}-r{r}.json"))) for r in range(world)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    from unbroken.data.prepare.pack import pack

    root = str(tmp_path_factory.mktemp("data"))
    pack(
        ({"__key__": f"s{i:04d}", "txt": f"sample {i}"} for i in range(N_SAMPLES)),
        root,
        shard_size=1 << 20,
        progress=False,
    )
    return root


@pytest.fixture(scope="module")
def saved_on_1_2_4(tmp_path_factory, dataset: str) -> tuple[str, dict[int, str]]:
    """The same job saved on world sizes 1, 2 and 4: (the savers' output dir, root per size)."""
    base = tmp_path_factory.mktemp("reshard")
    out = str(base / "out")
    os.makedirs(out)
    roots = {w: str(base / f"saved-on-{w}") for w in (1, 2, 4)}
    for w, root in roots.items():
        _run(w, {"mode": "save", "roots": [root], "data": dataset, "steps": 2, "out": out})
    return out, roots


@pytest.mark.parametrize("w2", [1, 2, 3, 4])
def test_reshard_matrix_save_1_2_4_load_1_2_3_4(
    tmp_path, dataset: str, saved_on_1_2_4: tuple[str, dict[int, str]], w2: int
) -> None:
    saved, roots = saved_on_1_2_4
    out = str(tmp_path / "out")
    os.makedirs(out)
    _run(w2, {"mode": "load", "roots": list(roots.values()), "data": dataset, "out": out})
    loads = _results(out, "load", w2)
    for w, root in roots.items():
        saves = _results(saved, "save", w)
        before = [k for r in saves for k in r[root]["keys"]]
        after = [k for r in loads for k in r[root]["keys"]]
        tag = f"saved on {w}, loaded on {w2}"
        assert all(r[root]["step"] == 2 for r in loads), tag
        assert all(r[root]["model"] and r[root]["shard"] and r[root]["opt"] for r in loads), tag
        assert len(before) == 2 * w * BATCH, tag
        seen = before + after
        assert len(seen) == len(set(seen)), f"{tag}: duplicated samples"
        missing = set(f"s{i:04d}" for i in range(N_SAMPLES)) - set(seen)
        assert len(missing) < w2 * BATCH, (
            f"{tag}: missing {sorted(missing)}"
        )  # only the dropped tail


def test_corrupt_file_of_one_rank_makes_all_ranks_fall_back(tmp_path, dataset: str) -> None:
    out = str(tmp_path / "out")
    os.makedirs(out)
    root = str(tmp_path / "ck")
    # spawned: every rank a fresh interpreter with its own str hash seed (``_start_ranks``)
    _run(
        2, {"mode": "save", "roots": [root], "data": dataset, "steps": 2, "out": out}, None, "spawn"
    )
    newest = os.path.join(root, "step-00000002")
    victim = os.path.join(newest, "__1_0.distcp")  # written by rank 1
    assert os.path.getsize(victim) > 0
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    # expected.pt holds the step-2 model; step 1 is what all ranks must load now
    exp2 = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    _run(2, {"mode": "load", "roots": [root], "data": dataset, "out": out}, None, "spawn")
    loads = _results(out, "load", 2)
    assert [r[root]["step"] for r in loads] == [1, 1]
    assert not any(r[root]["model"] for r in loads), "step-1 weights must differ from step-2"
    assert os.path.isdir(os.path.join(root, "corrupt-step-00000002-checksum"))
    assert exp2  # the reference really was the newer step


def _fsdp_worker(rank: int, world: int, job: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unbroken.ckpt import Checkpointer, TrainState

    join_group(rank, world, job["rdzv"])
    try:
        mesh = init_device_mesh("cpu", (world,))

        def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(seed)
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
            for layer in m:
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
            return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

        m, opt = sharded(0)
        m(torch.ones(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

        class ModelAndOptim:  # the DCP state_dict helpers, as TorchTitan uses them
            def state_dict(self) -> dict[str, Any]:
                msd, osd = get_state_dict(m, opt)
                return {"model": msd, "optim": osd}

            def load_state_dict(self, sd: dict[str, Any]) -> None:
                set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        def full_optim(model: torch.nn.Module, o: torch.optim.Optimizer) -> dict[str, Any]:
            opts = StateDictOptions(full_state_dict=True)
            return cast(dict[str, Any], get_optimizer_state_dict(model, o, options=opts))["state"]

        st = TrainState(extras={"app": ModelAndOptim()})
        ck = Checkpointer(job["root"], st)
        direct = job["root"] + "-direct"  # the model and optimizer handed over as they are
        ref = os.path.join(job["root"], "full.pt")
        if job["mode"] == "save":
            for _ in range(2):  # a second step so the moments are non-trivial
                m(torch.ones(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
            st.step = 3
            ck.save()
            st2 = TrainState(model=m, optimizer=opt)
            st2.step = 3
            Checkpointer(direct, st2).save()
            full = {k: v.full_tensor() for k, v in m.state_dict().items()}
            moments = full_optim(m, opt)
            if rank == 0:
                torch.save({"model": full, "optim": moments}, ref)
        else:
            with torch.no_grad():
                for p in m.parameters():
                    p.zero_()
            assert ck.restore() == 3
            full = torch.load(ref, weights_only=True)
            same = all(
                torch.equal(full["model"][k], v.full_tensor()) for k, v in m.state_dict().items()
            )
            moments = opt.state_dict()["state"]
            # a fresh model and an optimizer that never stepped, as after a restart
            m2, opt2 = sharded(1)
            assert Checkpointer(direct, TrainState(model=m2, optimizer=opt2)).restore() == 3
            same2 = all(
                torch.equal(full["model"][k], v.full_tensor()) for k, v in m2.state_dict().items()
            )
            got = full_optim(m2, opt2)
            same2 = same2 and all(
                torch.equal(torch.as_tensor(v), torch.as_tensor(got[fqn][k]))
                for fqn, st_ in full["optim"].items()
                for k, v in st_.items()
            )
            with open(os.path.join(job["root"], f"fsdp-load-w{world}-r{rank}"), "w") as f:
                f.write(f"{same} {len(moments)} {same2} {len(got)}")
        ck.close()
    finally:
        dist.destroy_process_group()


def test_fsdp2_saved_on_2_loads_on_1_and_3(tmp_path) -> None:
    root = str(tmp_path / "ck")
    _start_ranks(_fsdp_worker, 2, {"mode": "save", "root": root})
    for w in (1, 3):
        _start_ranks(_fsdp_worker, w, {"mode": "load", "root": root})
        for r in range(w):
            got = open(os.path.join(root, f"fsdp-load-w{w}-r{r}")).read()
            assert got == "True 4 True 4", (w, r)


def _rank0_only_worker(rank: int, world: int, job: dict[str, Any]) -> None:
    from unbroken.ckpt import Checkpointer, TrainState

    join_group(rank, world, job["rdzv"])
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        st = TrainState(model=model)
        for step in range(1, 4):
            t = torch.ones(1)
            dist.all_reduce(t)  # the training loop's own collectives keep running
            st.step = step
            if rank == 0:  # DDP habit: only rank 0 checkpoints the replicated state
                Checkpointer(job["root"], st, distributed=False).save()
        dist.barrier()
        if rank == 1:
            assert Checkpointer(job["root"], st, distributed=False).restore() == 3
    finally:
        dist.destroy_process_group()


def test_rank0_only_checkpointing_does_not_involve_other_ranks(tmp_path) -> None:
    root = str(tmp_path / "ck")
    job = {"root": root}
    _start_ranks(_rank0_only_worker, 2, job)
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002", "step-00000003"]


# --- per-rank state (C-PER-RANK), DDP, and the writer lock held by rank 0 (C-ONE-WRITER) ---


class _Carried:
    """State carried across batches that differs per rank (an LSTM's hidden state)."""

    def __init__(self, h: torch.Tensor, n: int) -> None:
        self.h, self.n = h, n

    def state_dict(self) -> dict[str, Any]:
        return {"h": self.h, "n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.h.copy_(sd["h"])
        self.n = sd["n"]


def _ranked_build(rank: int, seed: int, wrap: bool, **kw: Any) -> tuple[Any, ...]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unbroken.ckpt import TrainState

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    ddp = DDP(model)
    own = torch.nn.Parameter(torch.zeros(3))  # not in DDP: its optimizer state is per rank
    opt = torch.optim.SGD([*ddp.parameters(), own], lr=0.1, momentum=0.9)
    hidden = _Carried(torch.zeros(2, 3), 0)
    shared = _Carried(torch.zeros(2), 0)
    st = TrainState(
        model=ddp if wrap else model,
        optimizer=opt,
        extras={"hidden": hidden, "shared": shared},
        replicated=["extra.shared"],
        seed=11,
        values={"best_val_loss": 1e9},  # issue 21 item 4: the same on every rank
        **kw,
    )
    return st, ddp, model, own, opt, hidden, shared


def _ranked_worker(rank: int, world: int, job: dict[str, Any]) -> None:
    import logging

    from unbroken.ckpt import Checkpointer

    join_group(rank, world, job["rdzv"])
    warnings: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("unbroken").addHandler(_Keep())
    out: dict[str, Any] = {"pid": os.getpid()}
    root, flat = job["root"], job["root"] + "-unwrapped"
    try:
        if job["mode"] == "save":
            for r, wrap in ((root, True), (flat, False)):
                st, ddp, model, own, opt, hidden, shared = _ranked_build(rank, 0, wrap)
                ddp(torch.ones(2, 4)).sum().backward()  # DDP averages: replicas stay equal
                (own * (rank + 1)).sum().backward()
                opt.step()
                hidden.h.fill_(rank + 1.0)
                hidden.n = 10 * rank
                shared.h.fill_(float(rank))  # declared replicated, yet differs: say so
                st.values["best_val_loss"] = 1.5
                st.step = 1
                ck = Checkpointer(r, st)
                ck.save()
                if wrap:
                    with open(os.path.join(r, ".lock")) as f:
                        out["lock_pid"] = json.load(f)["pid"]
                    out["momentum"] = opt.state[own]["momentum_buffer"].tolist()
                    out["weight"] = model.weight.tolist()
                dist.barrier()  # every rank has read the lock before rank 0's close() drops it
                ck.close()
        else:
            st, ddp, model, own, opt, hidden, shared = _ranked_build(
                rank, 1, True, **job.get("kw", {})
            )
            with pytest.raises(RuntimeError) as held:  # the test process holds this root
                Checkpointer(job["locked"], st).restore()
            out["refused"] = str(held.value)
            ck = Checkpointer(root, st)
            try:
                out["step"] = ck.restore()
            except ValueError as e:
                out["error"] = str(e)
                out["error_type"] = type(e).__name__
            else:
                out.update(
                    values=dict(st.values),
                    hidden=hidden.h.tolist(),
                    n=hidden.n,
                    shared=shared.h.tolist(),
                    momentum=opt.state[own]["momentum_buffer"].tolist(),
                    weight=model.weight.tolist(),
                )
            ck.close()
        out["warnings"] = warnings
        with open(os.path.join(job["out"], f"{job['mode']}-w{world}-r{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _ranked(world: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    _run(world, job, _ranked_worker)
    return _results(job["out"], job["mode"], world)


def test_per_rank_state_survives_resize_is_refused_ddp_is_unwrapped(tmp_path) -> None:
    from unbroken.ckpt import Checkpointer, TrainState, read_checkpoint

    out = str(tmp_path / "out")
    os.makedirs(out)
    root = str(tmp_path / "ck")
    save = _ranked(2, {"mode": "save", "root": root, "out": out})
    # the lock is rank 0's: both ranks see rank 0's pid in it
    assert [r["lock_pid"] for r in save] == [save[0]["pid"]] * 2
    assert save[0]["momentum"] != save[1]["momentum"]  # really per-rank values
    warned = " | ".join(save[0]["warnings"])
    assert "extra.shared" in warned and "optimizer" in warned, warned
    assert "extra.hidden" not in warned and "'model'" not in warned, warned
    assert not save[1]["warnings"], "rank 0 reports divergence, once"

    manifests = [
        json.load(open(os.path.join(r, "step-00000001", "manifest.json")))
        for r in (root, root + "-unwrapped")
    ]
    m = manifests[0]
    assert m["components"]["extra.hidden"] == {
        "sharing": "per_rank",
        "differs": True,
        "differing": ["<non-tensor state>", "h"],
    }
    assert m["components"]["model"] == {"sharing": "replicated", "differs": False, "differing": []}
    assert [m["tensors"][f"rank{r}/components/extra.hidden/h"]["rank"] for r in (0, 1)] == [0, 1]
    assert "components/model/weight" in m["tensors"]  # equal on both ranks: saved once
    assert not any(k.startswith("rank") and "/model/" in k for k in m["tensors"])
    from safetensors.torch import load_file

    from unbroken.ckpt.export import export_safetensors

    export_safetensors(root, str(tmp_path / "h.safetensors"), component="extra.hidden")
    assert load_file(str(tmp_path / "h.safetensors"))["h"].tolist() == [[1.0] * 3] * 2  # rank 0's
    # DDP-wrapped and unwrapped models give the same checkpoint
    assert manifests[0]["tensors"].keys() == manifests[1]["tensors"].keys()
    a, b = read_checkpoint(root), read_checkpoint(root + "-unwrapped")
    assert a["components"].keys() == b["components"].keys()
    ma, mb = a["components"]["model"], b["components"]["model"]
    assert ma.keys() == mb.keys() == {"weight", "bias"}
    assert all(torch.equal(ma[k], mb[k]) for k in ma)

    locked = str(tmp_path / "locked")
    holder = Checkpointer(locked, TrainState())
    holder.restore()  # this process is the writer of `locked` now
    try:
        same = _ranked(2, {"mode": "load", "root": root, "out": out, "locked": locked})
        for r, (s, got) in enumerate(zip(save, same, strict=True)):
            assert f"pid {os.getpid()}" in got["refused"], got["refused"]
            assert got["step"] == 1
            assert got["hidden"] == [[r + 1.0] * 3] * 2 and got["n"] == 10 * r
            assert got["shared"] == [float(r)] * 2  # its own copy, not rank 0's
            assert got["momentum"] == s["momentum"] and got["weight"] == s["weight"]
            assert got["values"] == {"best_val_loss": 1.5}

        one = _ranked(1, {"mode": "load", "root": root, "out": out, "locked": locked})[0]
        assert "extra.hidden" in one["error"] and "2" in one["error"], one["error"]
        assert "per_rank_on_resize" in one["error"], one["error"]
        assert one["error_type"] == "RestoreRefused"  # issue 21: a configuration fault

        kw = {"per_rank_on_resize": "skip"}
        one = _ranked(1, {"mode": "load", "root": root, "out": out, "locked": locked, "kw": kw})[0]
        assert one["step"] == 1
        assert one["hidden"] == [[0.0] * 3] * 2 and one["n"] == 0  # kept as constructed
        assert one["shared"] == [0.0, 0.0] and one["momentum"] == save[0]["momentum"]
        assert one["values"] == {"best_val_loss": 1.5}  # issue 21 item 4: 2 -> 1 ranks
        warned = " | ".join(one["warnings"])
        assert "extra.hidden" in warned and "extra.shared" in warned, warned
    finally:
        holder.close()


class _Planted:
    """A message that would run a command as the job's user if it were unpickled."""

    def __init__(self, proof: str) -> None:
        self.proof = proof

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.proof}",))


def _send_raw(obj: Any, group: Any, broadcast: bool) -> None:
    """What a process posing as a rank sends: the pickle, framed as the collective frames it."""
    import pickle

    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    if broadcast:
        dist.broadcast(n, src=0, group=group)
        dist.broadcast(data, src=0, group=group)
        return
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, n, group=group)
    padded = torch.zeros(int(max(sizes)), dtype=torch.uint8)
    padded[: data.numel()] = data
    dist.all_gather([torch.empty_like(padded) for _ in range(2)], padded, group=group)


def _posing_worker(rank: int, world: int, job: dict[str, Any]) -> None:
    from unbroken.ckpt.collectives import Comm

    join_group(rank, world, job["rdzv"])
    comm = Comm()
    said = []
    # round 1: rank 1 poses in a gather; round 2: rank 0 poses in a broadcast
    for poser, call in ((1, "gather"), (0, "broadcast")):
        if rank == poser:
            _send_raw(_Planted(job["proof"]), comm.group, call == "broadcast")
            continue
        try:
            got = comm.gather("mine") if call == "gather" else comm.broadcast("ok")
            said.append(f"accepted {got!r}")
        except RuntimeError as e:
            said.append(str(e))
    with open(os.path.join(job["out"], f"said-{rank}.json"), "w") as f:
        json.dump(said, f)
    comm.destroy()
    dist.destroy_process_group()


def test_a_message_from_a_process_posing_as_a_rank_runs_no_code(tmp_path) -> None:
    """Whoever reaches the job's store can join its groups: what it sends into a
    checkpoint collective is refused by rank, and nothing it names is called."""
    proof = str(tmp_path / "ran")
    _run(2, {"out": str(tmp_path), "proof": proof}, _posing_worker)
    assert not os.path.exists(proof), "a peer's message ran a command"
    for rank, poser in ((0, 1), (1, 0)):
        (said,) = json.load(open(tmp_path / f"said-{rank}.json"))
        assert f"from rank {poser} is refused" in said and "posix.system" in said, said
        assert "trusted network" in said


def _archive_typo_worker(rank: int, world: int, job: dict[str, Any]) -> None:
    from unbroken.ckpt import ArchiveConfig, Checkpointer, TrainState

    os.environ.update(job["env"])
    join_group(rank, world, job["rdzv"])
    st = TrainState(model=torch.nn.Linear(2, 2))
    ck = Checkpointer(os.path.join(job["out"], "root"), st, archive=ArchiveConfig(job["url"]))
    try:
        ck.restore()
        said = "restored"
    except Exception as e:  # noqa: BLE001 - what each rank is told is the result
        said = f"{type(e).__name__}: {e}"
    with open(os.path.join(job["out"], f"said-{rank}.json"), "w") as f:
        json.dump(said, f)
    ck.close()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_an_archive_rank_0_cannot_read_fails_every_rank_not_a_hang(tmp_path) -> None:
    """Rank 0 lists the archive while the others wait in a broadcast: its failure (here a
    bucket that does not exist) reaches them as an error instead of leaving them waiting
    for the process group's timeout (30 min)."""
    from datakit import S3_TEST_CREDS
    from storekit import moto_endpoint

    with moto_endpoint() as ep:
        env = {**S3_TEST_CREDS, "AWS_ENDPOINT_URL": ep}
        job = {"out": str(tmp_path), "env": env, "url": "s3://typo/run"}
        _run(2, job, _archive_typo_worker)
    said = [json.load(open(tmp_path / f"said-{r}.json")) for r in range(2)]
    assert "bucket 'typo' does not exist" in said[0], said
    assert said[1].startswith("RuntimeError: rank 0 could not fetch from the archive"), said
    assert "bucket 'typo' does not exist" in said[1], said
