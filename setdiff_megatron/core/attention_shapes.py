"""The inputs every set-causal attention takes and their checks: q/k/v shapes, L, padding rows,
and the signature of a training implementation.

The token axis of k/v holds 2L tokens, [clean stream ; query stream], both in rank order; q holds
the same 2L rows or only the L query rows. `valid_len[b]` ranks are real in each stream; ranks at
or beyond it are padding, whose outputs are defined as zero (the order policies put padding last,
so no real row sees them).

Shapes: B batch, H query heads, G key/value heads (GQA: H % G == 0), L ranks per stream,
T tokens in a sampling step, C cached tokens, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["AttentionImpl", "check_qkv", "stream_length", "valid_row_mask"]

AttentionImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]
"""A training implementation: (q, k, v, scale, valid_len) -> out."""


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_rows_only: bool = False) -> None:
    """Shapes of q/k/v; with `query_rows_only` q may also hold half of k's tokens."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [batch, heads, tokens, head_dim]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    rows_ok = q.shape[2] == k.shape[2] or (query_rows_only and 2 * q.shape[2] == k.shape[2])
    if q.shape[0] != k.shape[0] or not rows_ok or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, tokens and head_dim")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


def valid_row_mask(valid_len: torch.Tensor, length: int, streams: int = 2) -> torch.Tensor:
    """[B, 1, streams * L, 1] bool mask of real rows in both streams (or the query stream)."""
    ranks = torch.arange(length, device=valid_len.device)
    valid_BL = ranks[None, :] < valid_len[:, None]
    return valid_BL.repeat(1, streams)[:, None, :, None]


def stream_length(k: torch.Tensor, valid_len: torch.Tensor | None) -> int:
    """L, from the keys (always both streams)."""
    two_l = k.shape[2]
    if two_l < 2 or two_l % 2:
        raise ValueError(f"the token axis must hold two streams of L >= 1 ranks (2L tokens); got {two_l}")
    length = two_l // 2
    if valid_len is not None:
        if valid_len.shape != (k.shape[0],):
            raise ValueError(f"valid_len must have shape [batch]={k.shape[0]}; got {tuple(valid_len.shape)}")
        if bool((valid_len < 0).any()) or bool((valid_len > length).any()):
            raise ValueError(f"valid_len must lie in [0, L={length}]")
    return length
