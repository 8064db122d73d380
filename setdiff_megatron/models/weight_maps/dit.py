"""The weight map between the reference's DiT checkpoints and the torch model: blocks.{i} are
layers.{i}, its fused attn_qkv holds [q ; k ; v] rows (each heads x head dim), its MLP is mlp.0
(up) and mlp.2 (down), its output layer output_layer.linear beside output_layer.norm_final;
with adaLN, sigma_map's MLP (mlp.0, mlp.2) and the adaLN_modulation of each block and of the
output layer (docs/dit.md).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.torch_layout import (
    ADALN_GLOBAL,
    ADALN_LAYER,
    EMBED,
    FINAL_NORM,
    OUTPUT,
    OUTPUT_BIAS,
    QKV,
    ROTARY_BUFFER,
    TORCH_LAYER,
    StateDict,
    check_shapes,
)

__all__ = ["DIT_ROTARY", "dit_to_torch", "torch_to_dit"]

_DIT_LAYER = {
    # the reference DiT's name under blocks.{i}. -> the torch name under layers.{i}.
    "norm1.weight": "input_layernorm.weight",
    "attn_out.weight": "self_attn.o_proj.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "mlp.0.weight": "mlp.up_proj.weight",
    "mlp.0.bias": "mlp.up_proj.bias",
    "mlp.2.weight": "mlp.down_proj.weight",
    "mlp.2.bias": "mlp.down_proj.bias",
    "adaLN_modulation.weight": ADALN_LAYER[0],
    "adaLN_modulation.bias": ADALN_LAYER[1],
}
_DIT_QKV = "attn_qkv.weight"
_DIT_GLOBAL = {
    "vocab_embed.embedding": EMBED,
    "output_layer.norm_final.weight": FINAL_NORM,
    "output_layer.linear.weight": OUTPUT,
    "output_layer.linear.bias": OUTPUT_BIAS,
    **dict(
        zip(
            (
                "sigma_map.mlp.0.weight",
                "sigma_map.mlp.0.bias",
                "sigma_map.mlp.2.weight",
                "sigma_map.mlp.2.bias",
                "output_layer.adaLN_modulation.weight",
                "output_layer.adaLN_modulation.bias",
            ),
            ADALN_GLOBAL,
        )
    ),
}
DIT_ROTARY = ROTARY_BUFFER
"""The reference DiT's stored rotary frequencies: no weight (its importer checks them against rope_theta)."""


def dit_to_torch(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """The torch model's weights from the reference DiT's (its backbone names, prefixes removed;
    `DIT_ROTARY` is left to the importer): every weight must be mapped and have its shape."""
    out: StateDict = {}
    unknown = []
    for name, t in state_dict.items():
        block, _, rest = name.removeprefix("blocks.").partition(".")
        in_block = name.startswith("blocks.") and block.isdigit()
        if name in _DIT_GLOBAL:
            out[_DIT_GLOBAL[name]] = t
        elif in_block and rest in _DIT_LAYER:
            out[TORCH_LAYER.format(block) + _DIT_LAYER[rest]] = t
        elif in_block and rest == _DIT_QKV and t.shape[0] % 3 == 0:
            out |= {TORCH_LAYER.format(block) + n: part for n, part in zip(QKV, t.chunk(3))}
        elif name != DIT_ROTARY:
            unknown.append(name)
    if unknown:
        raise KeyError(f"reference DiT weights not mapped: {sorted(unknown)}")
    check_shapes(out, cfg)
    return out


def torch_to_dit(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """The reference DiT's names for the torch model's weights (q, k and v fused into attn_qkv);
    `dit_to_torch` inverts it."""
    check_shapes(state_dict, cfg)
    to_dit = {torch_name: dit for dit, torch_name in _DIT_GLOBAL.items()}
    out: StateDict = {}
    for name, t in state_dict.items():
        layer, _, rest = name.removeprefix("layers.").partition(".")
        if name in to_dit:
            out[to_dit[name]] = t
        elif rest in _DIT_LAYER.values():
            out[f"blocks.{layer}." + next(k for k, v in _DIT_LAYER.items() if v == rest)] = t
        elif rest == QKV[0]:
            out[f"blocks.{layer}.{_DIT_QKV}"] = torch.cat([state_dict[TORCH_LAYER.format(layer) + n] for n in QKV])
    return out
