"""The demo model shared by the demo trainer and the demo engine: a tiny MLP that learns y = sin(x)."""

from __future__ import annotations

import torch
from torch import nn


class DemoModel(nn.Module):
    steps: torch.Tensor  # a registered buffer (published with the weights); declared so its type is a Tensor

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch(gen: torch.Generator, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(n, 1, generator=gen) * 6.0 - 3.0
    return x, torch.sin(x)
