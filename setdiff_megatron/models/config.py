"""The model family: one dataclass for every body (torch, megatron, Hugging Face).

A Llama/Qwen-style decoder (RMSNorm, rotary embeddings, grouped-query attention with optional
q/k norm, SwiGLU MLP, tied or untied output layer) whose attention is set-causal and whose
rotary position ids are the ORIGINAL positions of tokens laid out in a sampled order. The MASK
token is an ordinary row of the embedding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from setdiff_megatron.kernels import ATTENTION_IMPL_NAMES  # also registers 'auto', 'te', 'flash_attn'

__all__ = ["ModelConfig", "FLAVORS"]


@dataclass(kw_only=True)
class ModelConfig:
    # Recipes validate this dataclass with pydantic; unknown keys must be rejected there too.
    __pydantic_config__ = {"extra": "forbid"}

    vocab_size: int | None = None
    """Rows of the embedding and of the output layer, MASK included; None until a recipe's
    tokenizer fills it in (see `resolved`)."""
    mask_token_id: int | None = None
    """Token fed to every query-stream slot; never predicted. None: the tokenizer's MASK."""
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads (plain MHA)."""
    head_dim: int | None = None
    """None means hidden_size // num_heads."""
    intermediate_size: int | None = None
    """SwiGLU width; None means 8/3 * hidden_size rounded up to a multiple of 64."""
    max_seq_len: int = 1024
    """Longest training sequence L (each example is 2L tokens inside the model)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys before rotary (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2); the output projection has none."""
    tie_embeddings: bool = True
    attention_impl: str = "fused"
    """Set-causal attention: 'fused' (default; the decomposition on PyTorch's flash kernels), 'auto'
    (the best this machine has per device and dtype, logged once), 'te' (Transformer Engine cuDNN,
    BF16, FP8 under train.fp8 with fp8_recipe delayed), 'flash_attn' (flash-attn 2), 'sdpa' (masked)
    or 'dense' (reference). 'te' and 'flash_attn' need a CUDA GPU; see README 'Attention kernels'."""
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                    "unless head_dim is given"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = -(-(8 * self.hidden_size // 3) // 64) * 64
        for name in ("num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings; got {self.head_dim}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1; got {self.vocab_size}")
        if (self.vocab_size is not None and self.mask_token_id is not None
                and not 0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(f"mask_token_id must lie in [0, vocab_size={self.vocab_size}); got {self.mask_token_id}")
        if self.attention_impl not in ATTENTION_IMPL_NAMES:
            raise ValueError(f"attention_impl must be one of {list(ATTENTION_IMPL_NAMES)}; got {self.attention_impl!r}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def resolved(self) -> "ModelConfig":
        """This config, checked to be complete enough to build a model."""
        if self.vocab_size is None or self.mask_token_id is None:
            raise ValueError("vocab_size and mask_token_id must be set (a recipe takes them from its tokenizer)")
        return self

    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + 2 * h * kv
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        biases = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + norms + biases) + embed + h


FLAVORS: dict[str, dict] = {
    # Tests and smoke runs: builds in milliseconds on a CPU.
    "debug": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128),
    # About a million parameters without the embedding: the tiny CPU recipe.
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, max_seq_len=256),
    # The OpenWebText 110M class of the paper (GPT-2 small shape).
    "110m": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048, max_seq_len=1024),
}
