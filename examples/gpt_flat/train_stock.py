"""A nanoGPT-style training script, as most LLM training scripts are written (the "before").

    python examples/gpt_flat/prepare.py --input corpus.txt --out data/
    python examples/gpt_flat/train_stock.py --data-dir data --out-dir out
    torchrun --nproc-per-node 2 examples/gpt_flat/train_stock.py --data-dir data --out-dir out

Flat ``uint16`` token files read by a random ``get_batch``, the next batch prefetched before the
backward pass, ``iter_num`` and ``best_val_loss`` as plain globals, evaluation on rank 0, a
``ckpt.pt`` overwritten in place, DDP over ``torchrun``. ``train.py`` beside it is the same
script made resumable with unbroken; a test counts the lines between the two.
"""

import argparse
import math
import os
import pickle
import time

import numpy as np
import torch
from model import GPT, GPTConfig
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--data-dir", required=True)
p.add_argument("--out-dir", required=True)
p.add_argument("--max-iters", type=int, default=60)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--block-size", type=int, default=32)
p.add_argument("--gradient-accumulation-steps", type=int, default=2)
p.add_argument("--eval-interval", type=int, default=20)
p.add_argument("--eval-iters", type=int, default=4)
p.add_argument("--learning-rate", type=float, default=1e-3)
p.add_argument("--backend", default="gloo")
a = p.parse_args()

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=a.backend)
    ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert a.gradient_accumulation_steps % ddp_world_size == 0  # noqa: S101 - as nanoGPT has it
    gradient_accumulation_steps = a.gradient_accumulation_steps // ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
    gradient_accumulation_steps = a.gradient_accumulation_steps
os.makedirs(a.out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
block_size, batch_size = a.block_size, a.batch_size


def get_batch(split):
    data = np.memmap(os.path.join(a.data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
    )
    return x, y


with open(os.path.join(a.data_dir, "meta.pkl"), "rb") as f:
    meta_vocab_size = pickle.load(f)["vocab_size"]
iter_num = 0
best_val_loss = 1e9
model = GPT(GPTConfig(block_size=block_size, vocab_size=meta_vocab_size))
optimizer = model.configure_optimizers(0.1, a.learning_rate, (0.9, 0.95))
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(a.eval_iters)
        for k in range(a.eval_iters):
            X, Y = get_batch(split)
            _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    warmup_iters, min_lr = 10, a.learning_rate / 10
    if it < warmup_iters:
        return a.learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / (a.max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (a.learning_rate - min_lr)


X, Y = get_batch("train")  # fetch the very first batch
t0 = time.time()
while iter_num <= a.max_iters:  # tested first: a run restored at its end trains no step
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % a.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"].item()
            if iter_num > 0:
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                }
                torch.save(checkpoint, os.path.join(a.out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")  # prefetch the next batch while the backward pass runs
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if master_process and iter_num % 10 == 0:
        print(
            f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, {dt * 1000:.0f}ms"
        )
    iter_num += 1

if ddp:
    destroy_process_group()
