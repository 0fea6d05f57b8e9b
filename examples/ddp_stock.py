"""A stock PyTorch DDP training loop: a small LSTM language model on a text file.

    torchrun --nproc-per-node 2 examples/ddp_stock.py --data corpus.txt --out run

The "before" of examples/ddp_unbroken.py: the diff between the two files is exactly what
adopting unbroken costs (README, "From a stock DDP loop"; a test keeps it under 30 lines).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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

    with open(a.data, "rb") as f:
        tokens = torch.tensor(list(f.read()), dtype=torch.long)
    n = (len(tokens) - 1) // a.seq_len
    dataset = TensorDataset(tokens[: n * a.seq_len + 1].unfold(0, a.seq_len + 1, a.seq_len))
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=a.batch // world, sampler=sampler, drop_last=True)

    model = DDP(CharLSTM(a.vocab))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    step, epoch = 0, 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        for (x,) in loader:
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step == a.steps:
                break
        epoch += 1
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(a.out, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
