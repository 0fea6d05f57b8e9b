"""A tiny recurrent language model whose hidden state is carried from batch to batch (as in
pytorch/examples' word_language_model), registered with ``TrainState(extras=...)``.

``--break hidden`` plants a restore bug: the carried state's ``load_state_dict`` resets it
instead of loading it, so a resumed run continues from a zero state - the drill must name
``extra.hidden``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from unbroken.ckpt import Checkpointer, TrainState
from unbroken.common.metrics import MetricLog
from unbroken.data import StatefulLoader, StreamingDataset
from unbroken.demo.train import CTX, prepare_data
from unbroken.elastic import beat

BATCH, WIDTH = 8, 32


class Carried:
    """The hidden state between batches, as a Stateful extra."""

    def __init__(self, forget: bool) -> None:
        self.h = torch.zeros(1, BATCH, WIDTH)
        self.forget = forget

    def state_dict(self) -> dict[str, Any]:
        return {"h": self.h}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # the planted bug: start from a zero state instead of the saved one
        self.h = torch.zeros_like(sd["h"]) if self.forget else sd["h"].clone()


def decode(sample: dict[str, Any]) -> dict[str, Any]:
    return {"x": torch.from_numpy(np.frombuffer(sample["tok"], np.uint8).astype(np.int64))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--break", dest="broken", choices=["hidden"], default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    data = os.path.join(a.dir, "data")
    vocab = prepare_data(data, 0, CTX)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(vocab, WIDTH),
            "rnn": torch.nn.GRU(WIDTH, WIDTH, batch_first=True),
            "head": torch.nn.Linear(WIDTH, vocab),
        }
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ds = StreamingDataset(data, seed=0, transform=decode, with_ids=True)
    loader = StatefulLoader(ds, batch_size=BATCH, last_batch="drop")
    hidden = Carried(a.broken == "hidden")
    metrics = MetricLog(os.path.join(a.dir, "metrics.jsonl"))
    state = TrainState(
        model=model, optimizer=opt, loader=loader, metrics=metrics, extras={"hidden": hidden}
    )
    ckpt = Checkpointer(os.path.join(a.dir, "ckpt"), state, every_steps=5, keep_last=2)
    state.step = ckpt.restore() or 0
    while state.step < a.steps:
        for batch in loader:
            x = batch["x"]
            out, h = model["rnn"](model["emb"](x[:, :-1]), hidden.h)
            loss = F.cross_entropy(model["head"](out).flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            hidden.h = h.detach()  # truncated backpropagation through time: carried over
            state.step += 1
            metrics.log(state.step, loss=loss.item(), ids=batch["__id__"].tolist())
            ckpt.maybe_save()
            beat(state.step)
            if state.step >= a.steps:
                break
    ckpt.close()


if __name__ == "__main__":
    main()
