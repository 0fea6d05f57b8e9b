"""examples/ddp_stock.py after adopting unbroken: resumable, supervised and drillable.

    unbroken data tokenize corpus.txt tok --train-bpe 512 --seq-len 32    # once: token shards
    unbroken run --nproc-per-node 2 -- examples/ddp_unbroken.py --data tok --out run
    unbroken drill --multi-rank -- examples/ddp_unbroken.py --data tok --out {dir}

The diff against the stock loop is what adopting unbroken costs (README, "From a stock DDP
loop"; a test keeps it under 30 lines).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from unbroken import MetricLog, global_ids
from unbroken.ckpt import Checkpointer, TrainState
from unbroken.data import StatefulLoader, StreamingDataset
from unbroken.elastic import beat, finishing


class CharLSTM(torch.nn.Module):
    def __init__(self, vocab: int, width: int = 64) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.lstm = torch.nn.LSTM(width, width, batch_first=True)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.drop(self.emb(x)))
        return self.head(self.drop(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="global batch, over all ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    dataset = StreamingDataset(a.data, seed=0, seq_len=a.seq_len, with_ids=True)
    loader = StatefulLoader(dataset, batch_size=a.batch // world, last_batch="drop")

    model = DDP(CharLSTM(a.vocab))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    metrics = MetricLog(os.path.join(a.out, "metrics.jsonl"))
    state = TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, metrics=metrics)
    ckpt = Checkpointer(os.path.join(a.out, "ckpt"), state, every_steps=10)
    state.step = ckpt.restore() or 0
    while state.step < a.steps:
        for x, ids in loader:
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            state.step += 1
            metrics.log(state.step, loss=loss.item(), ids=global_ids(ids), world_size=world)
            ckpt.maybe_save()
            beat(state.step)
            if rank == 0 and state.step % 10 == 0:
                print(f"step {state.step} loss {loss.item():.4f}", flush=True)
            if state.step == a.steps:
                break
    finishing()  # the final save and exit get --shutdown-timeout, not --hang-timeout
    ckpt.close()
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(a.out, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
