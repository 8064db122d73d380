"""Read a set diffusion Hugging Face export back as (ModelConfig, torch state dict, tokenizer),
without transformers: the sampler, evaluation and `convert from-hf` use it. Safetensors only."""

from __future__ import annotations

from pathlib import Path

import torch

from setdiff_megatron.data.tokenizers import SetDiffTokenizer, load_tokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.hf.config_map import model_config_from_hf_config
from setdiff_megatron.hf.weights_io import load_safetensors_dir
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps import hf_to_torch

__all__ = ["load_hf_export", "is_hf_export"]


def is_hf_export(directory: str | Path) -> bool:
    from setdiff_megatron.hf.sources import read_hf_config

    directory = Path(directory)
    return (directory / "config.json").is_file() and read_hf_config(directory).get("model_type") == "setdiff"


def load_hf_export(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], SetDiffTokenizer]:
    """The model config, the torch model's weights (in their saved dtype) and the tokenizer."""
    from setdiff_megatron.hf.sources import read_hf_config

    directory = Path(directory)
    config = read_hf_config(directory)
    if config.get("model_type") != "setdiff":
        raise UserError(f"{directory} holds a {config.get('model_type')!r} model, not a set diffusion export; "
                        "import it first with `setdiff convert from-hf`")
    try:
        cfg = model_config_from_hf_config(config)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{directory / 'config.json'} is not a valid set diffusion config: {exc}") from None
    try:
        state = hf_to_torch(load_safetensors_dir(directory), cfg)
    except (KeyError, ValueError) as exc:
        raise UserError(f"{directory}: weights do not match config.json: {exc}") from None
    if not (directory / "tokenizer.json").is_file():
        raise UserError(f"{directory} has no tokenizer.json; a set diffusion export ships its tokenizer")
    tokenizer = load_tokenizer(directory, add_missing_tokens=False)
    if tokenizer.mask_id != cfg.mask_token_id:
        raise UserError(f"{directory}: config.json says mask_token_id {cfg.mask_token_id}, the tokenizer's MASK is "
                        f"{tokenizer.mask_id}")
    return cfg, state, tokenizer
