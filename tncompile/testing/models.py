"""Reference models for the demo, tests, benchmarks and ``tncompile inspect``."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SixEncoder", "six_encoder", "small_encoder", "mlp"]


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v/o projections (as CoMERA)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.size(0), x.size(1), x.size(2)

        def heads(h):
            return h.view(b, t, self.n_heads, self.d_head).transpose(1, 2)
        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head) + mask
        ctx = self.dropout(scores.softmax(-1)) @ v
        return self.out(ctx.transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float):
        super().__init__()
        self.attention = SelfAttention(d_model, n_heads, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.attention(x, mask)))
        return self.norm2(x + self.dropout(self.ff2(F.gelu(self.ff1(x)))))


class SixEncoder(nn.Module):
    """CoMERA's text classifier: token + position embeddings, post-norm
    encoder layers, mean-pooled over non-padding tokens, a linear classifier.

    Input ``ids`` of shape ``(batch, seq)`` (0 is padding); output logits
    ``(batch, num_classes)``.
    """

    def __init__(self, vocab_size: int = 30522, d_model: int = 768, n_layers: int = 6,
                 n_heads: int = 12, d_ff: int = 3072, max_len: int = 128, num_classes: int = 3,
                 dropout: float = 0.1, pad_id: int = 0):
        super().__init__()
        self.pad_id = pad_id
        self.token_embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.layers = nn.ModuleList(EncoderLayer(d_model, n_heads, d_ff, dropout) for _ in range(n_layers))
        self.classifier = nn.Linear(d_model, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = (ids != self.pad_id).to(self.norm.weight.dtype)             # (b, t)
        mask = ((1.0 - keep) * -1e9)[:, None, None, :]                     # (b, 1, 1, t)
        x = self.token_embedding(ids) + self.position_embedding(
            torch.arange(ids.size(1), device=ids.device))
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x, mask)
        pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1.0)
        return self.classifier(pooled)


def six_encoder(**overrides) -> SixEncoder:
    """The paper's configuration: 6 layers, d_model 768, 12 heads, d_ff 3072,
    vocab 30522, sequence 128, 3 classes."""
    return SixEncoder(**overrides)


def small_encoder(**overrides) -> SixEncoder:
    """A 2-layer, d_model 64 version for quick tests."""
    cfg = dict(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_len=32, num_classes=3)
    cfg.update(overrides)
    return SixEncoder(**cfg)


def mlp(sizes: tuple[int, ...] = (256, 512, 512, 10)) -> nn.Sequential:
    """A plain ReLU MLP."""
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])
