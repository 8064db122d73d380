"""The reference DiT's adaLN, as its MDLM and BD3-LM train it: a learned modulation of every norm.

The reference builds DiT-style adaptive norms (a timestep embedding, a zero-initialised linear
per block giving shift, scale and gate for attention and MLP, and one for the final norm giving
shift and scale) but never passes a timestep: its denoisers call the backbone without `sigma`,
which then embeds sigma = 0 (kuleshov-group/setdlms, src/backbone/dit.py `DIT.forward`). So the
conditioning vector is the same for every token and batch; what training learns is a per-layer
shift, scale and gate, parameterised as the reference parameterises them so that its releases
load and train on from where they stopped (docs/dit.md, "adaLN").

Shapes: E hidden, C conditioning width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FREQUENCIES", "Modulation", "TimestepEmbedding", "modulate"]

FREQUENCIES = 256
"""Width of the sinusoidal timestep embedding the conditioning MLP reads (the reference's)."""
_INIT_SEED = 0
"""The conditioning MLP is drawn from its own generator: every pipeline stage holds a copy of it
(megatron seeds each stage differently), and the copies must start equal."""


class TimestepEmbedding(nn.Module):
    """silu(MLP(sinusoid(0))): the conditioning vector [C] (the reference's `sigma_map` and the
    SiLU its DiT applies after it). sinusoid(0) is cos(0) = 1 on the first half, sin(0) = 0 on the
    second."""

    def __init__(self, cond_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.linear_1 = nn.Linear(FREQUENCIES, cond_dim, dtype=dtype)
        self.linear_2 = nn.Linear(cond_dim, cond_dim, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's own initialisation (the reference keeps it), from a fixed generator."""
        gen = torch.Generator().manual_seed(_INIT_SEED)
        with torch.no_grad():
            for linear in (self.linear_1, self.linear_2):
                weight = torch.empty(linear.weight.shape)
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
                bound = 1 / math.sqrt(linear.in_features)
                linear.weight.copy_(weight)
                linear.bias.copy_(torch.empty(linear.bias.shape).uniform_(-bound, bound, generator=gen))

    def forward(self) -> torch.Tensor:
        half = FREQUENCIES // 2
        weight = self.linear_1.weight
        t0 = torch.cat([weight.new_ones(half), weight.new_zeros(half)])
        return F.silu(self.linear_2(F.silu(self.linear_1(t0))))


class Modulation(nn.Linear):
    """The conditioning vector -> `parts` vectors of the hidden size (shift, scale, gate, ...),
    zero at initialisation so that every block starts as the identity (adaLN-Zero)."""

    def __init__(self, cond_dim: int, hidden_size: int, parts: int, dtype: torch.dtype | None = None):
        super().__init__(cond_dim, parts * hidden_size, dtype=dtype)  # calls reset_parameters
        self.parts = parts

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, condition: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(condition).chunk(self.parts, dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift, broadcast over every token."""
    return x * (1 + scale) + shift
