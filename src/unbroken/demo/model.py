"""A tiny GPT (character level) and a synthetic corpus: the demo's model and data."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyGPT", "synthetic_corpus"]

_WORDS = (
    "the data must flow and the job must live shards stream from disk to memory "
    "while checkpoints land atomically and a killed run resumes on the same path"
).split()


def synthetic_corpus(n_chars: int, seed: int) -> tuple[np.ndarray, int]:
    """Deterministic text from a word-level Markov-ish process; returns (char ids, vocab)."""
    rng = np.random.default_rng(seed)
    alphabet = sorted(set(" ".join(_WORDS)) | {"."})
    idx = {c: i for i, c in enumerate(alphabet)}
    out: list[str] = []
    total = 0
    prev = 0
    while total < n_chars:
        prev = (prev + int(rng.integers(1, 4))) % len(_WORDS)
        w = _WORDS[prev] + ("." if rng.random() < 0.1 else " ")
        out.append(w)
        total += len(w)
    text = "".join(out)[:n_chars]
    return np.fromiter((idx[c] for c in text), dtype=np.int64, count=len(text)), len(alphabet)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout)
        )
        self.heads = heads
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        ctx: int = 32,
        d: int = 64,
        layers: int = 2,
        heads: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t)))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
