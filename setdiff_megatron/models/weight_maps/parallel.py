"""How megatron splits a model over ranks: layers over (virtual) pipeline stages, heads, KV groups,
the MLP width and the padded vocabulary over tensor-parallel ranks, experts over expert-parallel
ranks. The megatron weight map slices with these; the megatron body and recipe checks validate a
layout with them before anything is built.
"""

from __future__ import annotations

import math

import torch

from setdiff_megatron.models.config import ModelConfig

__all__ = [
    "VOCAB_PAD_MULTIPLE",
    "check_ep_split",
    "check_tp_split",
    "pad_vocab",
    "padded_vocab_size",
    "stage_layers",
    "tp_shard",
]

VOCAB_PAD_MULTIPLE = 128
"""Rows of megatron's vocabulary are padded to a multiple of lcm(128, tp): GEMM-friendly like
megatron's make_vocab_size_divisible_by, and the same padded size for every power-of-two TP up to
128, so a checkpoint reshards across TP without changing shape."""


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp_size)
    return -(-vocab_size // multiple) * multiple


def stage_layers(
    num_layers: int, pp_size: int, pp_rank: int, vp_size: int | None = None, vp_stage: int | None = None
) -> range:
    """Global layer indices held by one (virtual) pipeline stage: megatron's even split.

    With virtual stages, chunk `vp_stage` of rank `pp_rank` is model chunk vp_stage * pp + pp_rank.
    """
    num_chunks = pp_size * (vp_size or 1)
    if num_layers % num_chunks:
        raise ValueError(f"num_layers ({num_layers}) must divide evenly over {num_chunks} pipeline chunks")
    per_chunk = num_layers // num_chunks
    start = ((vp_stage or 0) * pp_size + pp_rank) * per_chunk
    return range(start, start + per_chunk)


def check_ep_split(cfg: ModelConfig, ep_size: int) -> None:
    """Megatron spreads each MoE layer's experts evenly over the expert-parallel ranks."""
    if ep_size > 1 and not cfg.num_experts:
        raise ValueError(f"expert parallelism (ep={ep_size}) needs a mixture of experts (model.num_experts > 0)")
    if cfg.num_experts % ep_size:
        raise ValueError(f"num_experts ({cfg.num_experts}) must be divisible by the expert-parallel size ({ep_size})")


def check_tp_split(cfg: ModelConfig, tp_size: int) -> None:
    """Megatron splits heads, KV groups and the MLP width evenly over TP ranks (no KV replication)."""
    widths = [("intermediate_size", cfg.intermediate_size)] if not all(cfg.moe_layers) else []
    if cfg.num_experts:
        widths.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads), *widths):
        if n % tp_size:
            raise ValueError(f"{name} ({n}) must be divisible by the tensor-parallel size ({tp_size})")


def tp_shard(t: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The rows (dim 0) or columns (dim 1) one TP rank holds; all of `t` when replicated (None)."""
    return t if dim is None else t.chunk(tp_size, dim=dim)[tp_rank]


def pad_vocab(t: torch.Tensor, cfg: ModelConfig, tp_size: int) -> torch.Tensor:
    """`t` [V, ...] with zero rows up to megatron's padded vocabulary (masked out of the logits)."""
    return torch.cat([t, t.new_zeros(padded_vocab_size(cfg.vocab_size, tp_size) - t.shape[0], *t.shape[1:])])
