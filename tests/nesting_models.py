"""Models whose units nest only after learning (see [Note: nested calls] in store/nesting.py), shared by
tests/test_nested_calls.py (CPU) and tests/test_gpu.py."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Two matmuls; an ``inner`` module passed in runs between them (inside this block's forward)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, inner: nn.Module | None = None) -> torch.Tensor:
        x = self.first(x)
        if inner is not None:
            x = torch.tanh(inner(x))
        return self.second(x)


class LateNesting(nn.Module):
    """``helper`` runs first; once ``nest_in`` names a block, that block calls it inside its forward too
    (a branch the learning forwards never took)."""

    def __init__(self, width: int = 32, helper_layers: int = 2, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.helper = nn.Sequential(*(nn.Linear(width, width) for _ in range(helper_layers)))
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.nest_in: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.helper(x)
        for i, block in enumerate(self.blocks):
            x = block(x, self.helper if i == self.nest_in else None)
        return x
