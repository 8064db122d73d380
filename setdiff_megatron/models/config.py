"""The model family: one dataclass for every body (torch, megatron, Hugging Face).

A pre-norm decoder with rotary embeddings, grouped-query attention with optional q/k norm and a
tied or untied output layer, whose attention is set-causal and whose rotary position ids are the
ORIGINAL positions of tokens laid out in a sampled order; MASK is an ordinary row of the embedding.
Two layouts, picked by `norm`, `mlp` and the bias fields: Llama/Qwen's (the defaults) and the
reference's DiT (`DIT_BODY`; docs/dit.md, "The layout"). With `num_experts > 0` some layers' MLPs
are mixtures of experts (docs/parallelism.md, "Mixture of experts").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from setdiff_megatron.core.attention import ATTENTION_IMPL_NAMES

__all__ = ["ModelConfig", "FLAVORS", "DIT_BODY", "NORMS", "MLPS"]

NORMS = ("rmsnorm", "layernorm")
MLPS = ("swiglu", "gelu")


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
    """MLP width; None means 8/3 * hidden_size rounded up to a multiple of 64 (swiglu), or
    4 * hidden_size (gelu, the DiT's ratio)."""
    max_seq_len: int = 1024
    """Longest training sequence L (each example is 2L tokens inside the model)."""
    rope_theta: float = 10000.0
    norm: str = "rmsnorm"
    """The block and final norms: 'rmsnorm', or 'layernorm' (a weight, no bias, computed in
    float32 whatever the activations' dtype, as the reference's DiT does)."""
    norm_eps: float = 1e-6
    mlp: str = "swiglu"
    """'swiglu' (gate, up and down projections, SiLU) or 'gelu' (up and down, tanh-approximated
    GELU: GPT-2's and the DiT's)."""
    mlp_bias: bool = False
    """Biases on the MLP's projections (the DiT's)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys before rotary (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2); the output projection has none."""
    tie_embeddings: bool = True
    output_bias: bool = False
    """A bias on the output layer, which must then be untied (the DiT's)."""
    adaln: bool = False
    """The reference DiT's adaLN (its LM1B MDLM and BD3-LM): a learned shift and scale after every
    norm and a gate on every residual branch, computed from the timestep embedding of t = 0 that
    the reference always passes (models/adaln.py; docs/dit.md)."""
    adaln_cond_dim: int = 128
    """Width of the adaLN conditioning vector (the reference DiT's cond_dim)."""
    attention_impl: str = "fused"
    """Set-causal attention: 'fused' (default; the decomposition on PyTorch's flash kernels), 'auto'
    (the best this machine has per device and dtype, logged once), 'te' (Transformer Engine cuDNN,
    BF16, FP8 under train.fp8 with fp8_recipe delayed), 'flash_attn' (flash-attn 2), 'sdpa' (masked)
    or 'dense' (reference). 'te' and 'flash_attn' need a CUDA GPU; see README 'Attention kernels'."""
    init_std: float = 0.02
    num_experts: int = 0
    """Routed experts of each MoE layer; 0: a dense model."""
    moe_top_k: int = 2
    """Experts each token is sent to."""
    moe_intermediate_size: int | None = None
    """SwiGLU width of one expert; None means intermediate_size."""
    num_shared_experts: int = 0
    """Experts every token goes through besides its routed ones (one MLP of num_shared_experts x
    moe_intermediate_size, ungated), as in DeepSeek-V3."""
    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE: k means layers 0, k, 2k, ... (megatron's convention); a list of
    num_layers 0/1 flags names them one by one."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k, the k probabilities not renormalised (Qwen3-MoE's
    norm_topk_prob false); needed with moe_top_k = 1, whose renormalised probability is always 1."""
    moe_aux_loss_coeff: float = 1e-2
    """Weight of the Switch load-balancing loss of each MoE layer."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE); 0 switches it off."""
    moe_capacity_factor: float | None = None
    """None: dropless. Otherwise each expert takes at most ceil(capacity_factor x tokens x top_k /
    experts) tokens of a micro-batch's layer input, keeping those of highest routing probability;
    the others skip the expert (their other choices and the residual remain)."""

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
        for name, value, allowed in (("norm", self.norm, NORMS), ("mlp", self.mlp, MLPS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}; got {value!r}")
        if self.output_bias and self.tie_embeddings:
            raise ValueError("output_bias needs tie_embeddings: false (the bias belongs to an output layer of its own)")
        if self.intermediate_size is None:
            self.intermediate_size = (
                4 * self.hidden_size if self.mlp == "gelu" else -(-(8 * self.hidden_size // 3) // 64) * 64
            )
        for name in ("num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings; got {self.head_dim}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1; got {self.vocab_size}")
        if (
            self.vocab_size is not None
            and self.mask_token_id is not None
            and not 0 <= self.mask_token_id < self.vocab_size
        ):
            raise ValueError(f"mask_token_id must lie in [0, vocab_size={self.vocab_size}); got {self.mask_token_id}")
        if self.attention_impl not in ATTENTION_IMPL_NAMES:
            raise ValueError(f"attention_impl must be one of {list(ATTENTION_IMPL_NAMES)}; got {self.attention_impl!r}")
        if self.adaln and (self.num_experts or self.norm != "layernorm" or self.adaln_cond_dim < 1):
            raise ValueError(
                "adaln is the reference DiT's: it needs norm: layernorm, a dense model (num_experts: 0) "
                "and adaln_cond_dim >= 1"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0: dense); got {self.num_experts}")
        if not self.num_experts:
            return
        if self.mlp != "swiglu" or self.mlp_bias:
            raise ValueError(
                "a mixture of experts has SwiGLU experts without biases: set mlp: swiglu and mlp_bias: false"
            )
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.moe_intermediate_size < 1 or self.num_shared_experts < 0:
            raise ValueError(
                "moe_intermediate_size must be >= 1 and num_shared_experts >= 0; got "
                f"{self.moe_intermediate_size}, {self.num_shared_experts}"
            )
        if not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"moe_top_k must lie in [1, num_experts={self.num_experts}]; got {self.moe_top_k}")
        if self.moe_top_k == 1 and not self.moe_router_pre_softmax:
            raise ValueError(
                "moe_top_k = 1 needs moe_router_pre_softmax: true (a softmax over one chosen expert is "
                "always 1 and trains no router)"
            )
        freq = self.moe_layer_freq
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1 or a list of 0/1 per layer; got {freq}")
        if isinstance(freq, list) and (len(freq) != self.num_layers or set(freq) - {0, 1} or not any(freq)):
            raise ValueError(
                f"moe_layer_freq as a list needs num_layers={self.num_layers} flags of 0/1, at least one 1; got {freq}"
            )
        if self.moe_aux_loss_coeff < 0 or self.moe_z_loss_coeff < 0:
            raise ValueError("moe_aux_loss_coeff and moe_z_loss_coeff must be >= 0")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError(f"moe_capacity_factor must be > 0, or None for dropless; got {self.moe_capacity_factor}")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is a mixture of experts."""
        if not self.num_experts:
            return (False,) * self.num_layers
        freq = self.moe_layer_freq
        return (
            tuple(bool(f) for f in freq)
            if isinstance(freq, list)
            else tuple(i % freq == 0 for i in range(self.num_layers))
        )

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def resolved(self) -> ModelConfig:
        """This config, checked to be complete enough to build a model."""
        if self.vocab_size is None or self.mask_token_id is None:
            raise ValueError("vocab_size and mask_token_id must be set (a recipe takes them from its tokenizer)")
        return self

    def num_params(self, *, active: bool = False) -> int:
        """Parameters of the model; `active`: those one token passes through (top-k experts)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + 2 * h * kv
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        biases = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2) + (self.vocab_size if self.output_bias else 0)
        total = self.num_layers * (attn + norms + biases) + embed + h
        if self.adaln:  # the conditioning MLP, 6 modulations per layer and the final norm's 2
            c = self.adaln_cond_dim
            total += (256 + c + 2) * c + (6 * self.num_layers + 2) * (c + 1) * h
        projections = 3 if self.mlp == "swiglu" else 2
        for moe in self.moe_layers:
            if moe:
                routed = self.moe_top_k if active else self.num_experts
                total += self.num_experts * h + 3 * h * self.moe_intermediate_size * (routed + self.num_shared_experts)
            else:
                width = self.intermediate_size
                total += projections * h * width + ((projections - 1) * width + h if self.mlp_bias else 0)
        return total


FLAVORS: dict[str, dict] = {
    # Tests and smoke runs: builds in milliseconds on a CPU.
    "debug": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128),
    # About a million parameters without the embedding: the tiny CPU recipe.
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, max_seq_len=256),
    # The OpenWebText 110M class of the paper (GPT-2 small shape).
    "110m": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048, max_seq_len=1024),
}

DIT_BODY: dict = dict(
    norm="layernorm",
    norm_eps=1e-5,
    mlp="gelu",
    mlp_bias=True,
    tie_embeddings=False,
    output_bias=True,
    rope_theta=10000.0,
)
"""The reference's DiT layout over the fields above (docs/dit.md): the paper's OpenWebText and
LM1B backbone. Its fused QKV and its attention output projection have no bias; its MLP width is
4 x hidden (the gelu default); its heads are plain multi-head attention."""
