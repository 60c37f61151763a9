"""RL heads of PI0.5: the critic (value head) and the learned exploration-noise head (flow-noise).

Both stay float32 whatever the model dtype (RLinf keeps them fp32 too).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .gemma import upcast


class ValueHead(nn.Module):
    """Linear-ReLU MLP ending in one unit: (B, in_dim) -> (B,) float32.

    Keys are `value_head.mlp.{0,2,4,6}.*` for three hidden layers, as RLinf's checkpoints.

    Example:
        >>> head = ValueHead(16, (8, 4))
        >>> head(torch.zeros(3, 16)).shape
        torch.Size([3])
    """

    def __init__(self, in_dim: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming-normal (fan_out) hidden layers, N(0, 0.02) output layer, zero biases (RLinf's init)."""
        linears = [m for m in self.mlp if isinstance(m, nn.Linear)]
        for layer in linears[:-1]:
            nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        nn.init.normal_(linears[-1].weight, std=0.02)
        nn.init.zeros_(linears[-1].bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Pooled features -> values."""
        return self.mlp(upcast(features))[..., 0]


class NoiseHead(nn.Module):
    """Elementwise exploration std from the expert output: MLP width -> hidden... -> D with tanh activations.

    The raw output r maps to log-variance log(s_min^2) + (log(s_max^2) - log(s_min^2)) (tanh r + 1) / 2,
    so s = exp(logvar / 2) lies in [s_min, s_max].

    Example:
        >>> head = NoiseHead(16, (8, 4), 32, (0.08, 0.16))
        >>> s = head(torch.randn(2, 5, 16)); bool(((s >= 0.08) & (s <= 0.16)).all())
        True
    """

    def __init__(self, in_dim: int, hidden: tuple[int, ...], out_dim: int, std_range: tuple[float, float]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.Tanh()]
            width = h
        layers.append(nn.Linear(width, out_dim))
        self.mlp = nn.Sequential(*layers)
        self.log_var_min = 2.0 * math.log(std_range[0])
        self.log_var_max = 2.0 * math.log(std_range[1])

    def forward(self, suffix_out: torch.Tensor) -> torch.Tensor:
        """(B, H, width) float32 -> std (B, H, D) float32."""
        r = self.mlp(upcast(suffix_out))
        log_var = self.log_var_min + (self.log_var_max - self.log_var_min) * (torch.tanh(r) + 1.0) * 0.5
        return torch.exp(0.5 * log_var)
