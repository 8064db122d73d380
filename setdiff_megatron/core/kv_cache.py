"""A preallocated KV cache of committed clean tokens, for the sampler.

Only clean tokens enter the cache; query (MASK) tokens are scored against it and forgotten. A
step's commits are written by each layer as it runs and become visible to later steps once the
model calls `advance` after its last layer, so every layer of one step sees the same cache.
Rows of a batch may commit different numbers of tokens in one step: `valid` marks the real
entries, and attention skips the others.

Shapes: N layers, B batch, G key/value heads, C capacity, D head dim, T step tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from setdiff_megatron.core.attention import set_causal_step_attention

__all__ = ["KVCache"]


@dataclass
class KVCache:
    keys: torch.Tensor  # [N, B, G, C, D]
    values: torch.Tensor  # [N, B, G, C, D]
    valid: torch.Tensor  # [B, C] bool
    length: int = 0
    has_holes: bool = False
    """Set once a row commits fewer tokens than another; until then attention needs no key mask."""

    @classmethod
    def allocate(cls, *, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype = torch.float32, device=None) -> "KVCache":
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        return cls(
            keys=torch.zeros(shape, dtype=dtype, device=device),
            values=torch.zeros(shape, dtype=dtype, device=device),
            valid=torch.zeros(batch_size, capacity, dtype=torch.bool, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def attend(self, layer: int, q_BHTD: torch.Tensor, k_BGTD: torch.Tensor, v_BGTD: torch.Tensor, *,
               num_commit: int, commit_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer's step tokens; writes the commits' K/V behind the cache."""
        if self.length + num_commit > self.capacity:
            raise ValueError(
                f"KV cache capacity {self.capacity} exceeded ({self.length} cached + {num_commit} new); "
                "allocate a larger capacity"
            )
        start, end = self.length, self.length + num_commit
        out = set_causal_step_attention(
            q_BHTD, k_BGTD, v_BGTD, self.keys[layer, :, :, :start], self.values[layer, :, :, :start],
            num_commit=num_commit, cache_mask=self.valid[:, :start] if self.has_holes else None,
            commit_mask=commit_valid,
        )
        self.keys[layer, :, :, start:end] = k_BGTD[:, :, :num_commit]
        self.values[layer, :, :, start:end] = v_BGTD[:, :, :num_commit]
        if layer == 0:
            self.valid[:, start:end] = True if commit_valid is None else commit_valid
        return out

    def advance(self, num_commit: int, *, partial: bool = False) -> None:
        """Make this step's commits visible; `partial` says some rows' commits were dummies."""
        self.length += num_commit
        self.has_holes = self.has_holes or partial
