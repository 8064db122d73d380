"""The decoding policy a model is sampled with when the caller names none.

A run decodes as its training order suggests, the paper's default (docs/method.md, "Decoding"):
a window of d queries with a threshold of 0.9 for the staggered schedule, one token per step for
left-to-right (AR) models, blocks of the training block size for block diffusion, a window of
16 at 0.9 for a uniform (MDLM) order. A Hugging Face export brings its generation_config.json.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from setdiff_megatron.core.decoding import DecodingConfig
from setdiff_megatron.recipes import Recipe
from setdiff_megatron.sources.hf_config import decoding_config_from_generation
from setdiff_megatron.sources.read import Source

__all__ = ["default_decoding", "decoding_for_recipe"]


def decoding_for_recipe(recipe: Recipe, **changes) -> DecodingConfig:
    method = recipe.method
    if method.order == "left_to_right" or (method.order == "staggered" and method.d == 1):
        window, block = 1, None
    elif method.order == "block":
        window, block = method.block_size, method.block_size
    else:
        window, block = (method.d if method.order == "staggered" else 16), None
    return DecodingConfig(
        **{"window": window, "block_size": block, "threshold": None if window == 1 else 0.9, **changes}
    )


def default_decoding(source: Source, **changes) -> DecodingConfig:
    """`source`'s default policy (module docstring), with `changes` over it."""
    if source.recipe is not None:
        return decoding_for_recipe(source.recipe, **changes)
    generation = Path(source.path) / "generation_config.json"
    if generation.is_file():
        values = json.loads(generation.read_text())
        values.pop("max_new_tokens", None)
        return replace(decoding_config_from_generation(values), **changes)
    return DecodingConfig(**changes)
