"""Read a Hugging Face directory's config, and a set diffusion export back as (ModelConfig,
torch state dict, tokenizer), without transformers. Safetensors only."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from setdiff_megatron.data.tokenizers import SetDiffTokenizer, load_tokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.hf import hf_to_torch
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sources.hf_config import (
    decoding_config_from_generation,
    model_config_from_hf_config,
    with_family_policy,
)
from setdiff_megatron.sources.hf_files import load_safetensors_dir

__all__ = ["read_hf_config", "load_hf_export", "export_policy"]


def read_hf_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


def load_hf_export(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], SetDiffTokenizer]:
    """The model config, the torch model's weights (in their saved dtype) and the tokenizer."""
    directory = Path(directory)
    config = read_hf_config(directory)
    if config.get("model_type") != "setdiff":
        raise UserError(
            f"{directory} holds a {config.get('model_type')!r} model, not a set diffusion export; "
            "import it first with `setdiff convert from-hf`"
        )
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
        raise UserError(
            f"{directory}: config.json says mask_token_id {cfg.mask_token_id}, the tokenizer's MASK is "
            f"{tokenizer.mask_id}"
        )
    return cfg, state, tokenizer


def export_policy(directory: str | Path) -> DecodingConfig:
    """The decoding policy an export carries in its generation_config.json (the exporter writes
    the trained model's own); its EOS is left to the caller, which stops there unless told not
    to. Keys it lacks (or no file): a baseline family's own policy (with_family_policy), else
    the sampler's defaults."""
    path = Path(directory) / "generation_config.json"
    try:
        values = json.loads(path.read_text()) if path.is_file() else {}
        generation = with_family_policy(values, read_hf_config(directory))
        return replace(decoding_config_from_generation(generation), eos_token_ids=())
    except (TypeError, ValueError) as exc:
        raise UserError(f"{path} is not a valid set diffusion generation config: {exc}") from None
