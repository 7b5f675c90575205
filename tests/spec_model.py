"""A model shaped like the spec's examples: embed, layers.N (attention, MLP, norm, a ``scale`` parameter),
a SharedExpertMLP, a MoELayer, head and lm_head. Small enough for CPU tests."""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.o(att @ v)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class SharedExpertMLP(MLP):
    """An always-on expert, as in hybrid MoE models."""


class MoELayer(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(MLP(dim, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(x), dim=-1)  # (B, T, E)
        return sum(weights[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


class Linear(nn.Module):
    """A user class that shares torch.nn.Linear's short name."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int, moe: bool) -> None:
        super().__init__()
        self.attn = Attention(dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = MoELayer(dim, hidden) if moe else MLP(dim, hidden)
        self.shared = SharedExpertMLP(dim, hidden)
        self.proj = Linear(dim)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        x = x + self.mlp(x) + self.shared(x)
        return self.proj(x) * self.scale


class SpecModel(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, hidden, moe=i % 2 == 1) for i in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.head(self.norm(x)))


def make_spec_model(seed: int = 0, **kwargs: int) -> SpecModel:
    torch.manual_seed(seed)
    return SpecModel(**kwargs).eval()


def spec_tokens(batch: int = 2, seq: int = 8, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
