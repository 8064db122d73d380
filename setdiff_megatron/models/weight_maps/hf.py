"""The weight map between the torch model and Hugging Face Llama/Qwen checkpoints (and our HF
export): the torch names under `model.`, except the untied output layer, which sits beside the
body as `lm_head.weight` and `lm_head.bias`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.torch_layout import (
    EMBED,
    OUTPUT,
    OUTPUT_BIAS,
    ROTARY_BUFFER,
    StateDict,
    check_shapes,
)

__all__ = ["HF_BODY", "hf_to_torch", "torch_to_hf"]

HF_BODY = "model."
"""Prefix of the body's weights in Hugging Face Llama/Qwen checkpoints (and in our HF export)."""
_HF_OUTSIDE = (OUTPUT, OUTPUT_BIAS)
"""Torch names that Hugging Face keeps beside the body, not under `model.`."""


def torch_to_hf(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """Hugging Face Llama/Qwen names for the torch model's weights (tensors are shared, not copied)."""
    check_shapes(state_dict, cfg)
    return {(name if name in _HF_OUTSIDE else HF_BODY + name): t for name, t in state_dict.items()}


def hf_to_torch(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """The torch model's weights from a Hugging Face Llama/Qwen state dict (or our HF export).

    Every weight must be mapped and have its shape; a tied model's stored `lm_head.weight`, which
    some checkpoints keep, must equal the embedding and is dropped.
    """
    out: StateDict = {}
    unknown = []
    for name, t in state_dict.items():
        if name.endswith(ROTARY_BUFFER):
            continue
        if name in _HF_OUTSIDE:
            out[name] = t
        elif name.startswith(HF_BODY):
            out[name[len(HF_BODY) :]] = t
        else:
            unknown.append(name)
    if unknown:
        raise KeyError(f"Hugging Face weights not mapped: {sorted(unknown)}")
    if cfg.tie_embeddings and OUTPUT in out:
        head = out.pop(OUTPUT)
        embed = out.get(EMBED)
        if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
            raise ValueError("lm_head.weight differs from the embedding although tie_word_embeddings is set")
    check_shapes(out, cfg)
    return out
