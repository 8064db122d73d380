"""What a recipe's sections mean for the layers below it: one reading, shared by training (the
data pipeline) and everything that reads a trained run (evaluation, sampling, the showcase)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from setdiff_megatron.data.supervised import RowFormat
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.recipes.schema import Recipe

__all__ = ["data_dir", "is_supervised", "row_format", "prompt_format"]


def data_dir(recipe: Recipe) -> Path:
    """Where the run's prepared corpora and sample indices live."""
    return Path(recipe.data.cache_dir or Path(recipe.checkpoint.dir) / "data")


def is_supervised(recipe: Recipe) -> bool:
    return recipe.data.datasets[0].format == "supervised"


def row_format(recipe: Recipe, tokenizer: SetDiffTokenizer) -> RowFormat:
    """How the recipe's supervised records become row tokens, and so how prompts are formatted at
    evaluation: BOS (method.keep_clean_bos), a prompt EOS, truncation (data.supervised)."""
    s = recipe.data.supervised
    return RowFormat(
        bos_id=tokenizer.bos_id if recipe.method.keep_clean_bos else None,
        prompt_eos_id=tokenizer.eos_id if s.prompt_eos else None,
        max_prompt_tokens=s.max_prompt_tokens,
        max_response_tokens=s.max_response_tokens,
        force_eos=s.force_eos,
    )


def prompt_format(recipe: Recipe | None, tokenizer: SetDiffTokenizer, add_bos: bool | None = None) -> RowFormat:
    """How a trained model's prompts are formatted (sampling, evaluation, serving): as its recipe's
    rows began, with `add_bos` over the BOS when given; a model with no recipe (a Hugging Face
    directory) gets its prompts as they are."""
    fmt = row_format(recipe, tokenizer) if recipe is not None else RowFormat()
    bos = fmt.bos_id is not None if add_bos is None else add_bos
    return replace(fmt, bos_id=tokenizer.bos_id if bos else None)
