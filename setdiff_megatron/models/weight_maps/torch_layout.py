"""The torch model's weight layout, the hub of every weight map: names (the upstream Hugging Face
Llama/Qwen ones, as `{}` templates over the layer index) and shapes, derived from the config
alone so that each map checks what it reads or writes.

Shapes: V vocabulary, E hidden, H heads, G key/value heads, D head dim, I MLP width.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from setdiff_megatron.models.adaln import FREQUENCIES
from setdiff_megatron.models.config import ModelConfig

__all__ = [
    "ADALN_GLOBAL",
    "ADALN_LAYER",
    "DOWN",
    "EMBED",
    "FINAL_NORM",
    "OUTPUT",
    "OUTPUT_BIAS",
    "QKV",
    "QKV_BIAS",
    "ROTARY_BUFFER",
    "ROUTER",
    "StateDict",
    "TORCH_LAYER",
    "add_vocabulary_rows",
    "check_shapes",
    "mlp_inputs",
    "mlp_params",
    "torch_shapes",
]

StateDict = dict[str, torch.Tensor]

TORCH_LAYER = "layers.{}."
EMBED = "embed_tokens.weight"
FINAL_NORM = "norm.weight"
OUTPUT = "lm_head.weight"
OUTPUT_BIAS = "lm_head.bias"
QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
ROUTER = "mlp.gate.weight"
"""An MoE layer's router (Qwen3-MoE's name)."""
_MLP_IN = {"swiglu": ("gate_proj", "up_proj"), "gelu": ("up_proj",)}
"""The input projections of an MLP, in the row order megatron's linear_fc1 fuses them."""
DOWN = "down_proj"
ADALN_LAYER = ("adaln_modulation.weight", "adaln_modulation.bias")
"""A layer's adaLN modulation (models/adaln.py): shift, scale, gate of attention, then of the MLP."""
ADALN_GLOBAL = (
    "time_embedding.linear_1.weight",
    "time_embedding.linear_1.bias",
    "time_embedding.linear_2.weight",
    "time_embedding.linear_2.bias",
    "norm_modulation.weight",
    "norm_modulation.bias",
)
"""adaLN outside the layers: the conditioning MLP and the final norm's shift and scale."""
ROTARY_BUFFER = "rotary_emb.inv_freq"
"""Rotary frequencies that older Hugging Face checkpoints and the reference's DiT store beside the
weights: recomputed from rope_theta, never read as a weight."""


def mlp_inputs(cfg: ModelConfig, moe: bool) -> tuple[str, ...]:
    """The input projections of a layer's MLP (experts are SwiGLU whatever `cfg.mlp`)."""
    return _MLP_IN["swiglu" if moe else cfg.mlp]


def mlp_params(cfg: ModelConfig, moe: bool) -> list[str]:
    """The suffixes of an MLP's parameters: weights, and the dense MLP's biases (experts have none)."""
    return [".weight"] + ([".bias"] if cfg.mlp_bias and not moe else [])


def torch_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every torch model weight and its shape, derived from the config alone."""
    e, d = cfg.hidden_size, cfg.head_dim
    layer = {
        "input_layernorm.weight": (e,),
        "post_attention_layernorm.weight": (e,),
        "self_attn.q_proj.weight": (cfg.num_heads * d, e),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * d, e),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * d, e),
        "self_attn.o_proj.weight": (e, cfg.num_heads * d),
    }
    if cfg.qk_norm:
        layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    if cfg.qkv_bias:
        layer |= dict(zip(QKV_BIAS, ((cfg.num_heads * d,), (cfg.num_kv_heads * d,), (cfg.num_kv_heads * d,))))

    def mlp(prefix: str, width: int, moe: bool = True) -> dict[str, tuple[int, ...]]:
        shapes = {f"{prefix}{n}.weight": (width, e) for n in mlp_inputs(cfg, moe)}
        shapes[f"{prefix}{DOWN}.weight"] = (e, width)
        if ".bias" in mlp_params(cfg, moe):
            shapes |= {f"{prefix}{n}.bias": (width,) for n in mlp_inputs(cfg, moe)} | {f"{prefix}{DOWN}.bias": (e,)}
        return shapes

    if cfg.adaln:
        layer |= dict(zip(ADALN_LAYER, ((6 * e, cfg.adaln_cond_dim), (6 * e,))))
    dense = layer | mlp("mlp.", cfg.intermediate_size, moe=False)
    moe = dict(layer)
    if cfg.num_experts:
        moe[ROUTER] = (cfg.num_experts, e)
        for x in range(cfg.num_experts):
            moe |= mlp(f"mlp.experts.{x}.", cfg.moe_intermediate_size)
        if cfg.num_shared_experts:
            moe |= mlp("mlp.shared_experts.", cfg.num_shared_experts * cfg.moe_intermediate_size)
    shapes = {
        TORCH_LAYER.format(n) + k: s
        for n, is_moe in enumerate(cfg.moe_layers)
        for k, s in (moe if is_moe else dense).items()
    }
    shapes |= {EMBED: (cfg.vocab_size, e), FINAL_NORM: (e,)}
    if not cfg.tie_embeddings:
        shapes[OUTPUT] = (cfg.vocab_size, e)
    if cfg.output_bias:
        shapes[OUTPUT_BIAS] = (cfg.vocab_size,)
    if cfg.adaln:
        c = cfg.adaln_cond_dim
        shapes |= dict(zip(ADALN_GLOBAL, ((c, FREQUENCIES), (c,), (c, c), (c,), (2 * e, c), (2 * e,))))
    return shapes


def check_shapes(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Every torch weight the config asks for, no other, each of its shape."""
    expected = torch_shapes(cfg)
    if set(sd) != set(expected):
        raise KeyError(
            f"torch weights: missing {sorted(set(expected) - set(sd))}, unexpected {sorted(set(sd) - set(expected))}"
        )
    bad = {k: (tuple(sd[k].shape), s) for k, s in expected.items() if tuple(sd[k].shape) != s}
    if bad:
        raise ValueError(f"torch weights with wrong shapes (got, expected): {bad}")


def add_vocabulary_rows(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, rows: int) -> StateDict:
    """The torch weights with the embedding and the untied output layer (weight and bias) grown
    to `rows` rows, each new one the mean of the existing ones: an "average token" whose scale
    matches the others (for token ids a source's vocabulary lacks)."""
    out = dict(state_dict)
    names = [EMBED] + ([] if cfg.tie_embeddings else [OUTPUT]) + ([OUTPUT_BIAS] if cfg.output_bias else [])
    for name in names:
        t = out[name]
        mean = t.float().mean(0, keepdim=True).to(t.dtype)
        out[name] = torch.cat([t, mean.expand(rows - t.shape[0], *t.shape[1:])])
    return out
