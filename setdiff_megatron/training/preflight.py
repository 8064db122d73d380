"""The one check before a training run, its launch or its validation: every refusal that can come
before any process starts or any step runs, in the order a user fixes them.

    recipe rules (recipes/validation.py)   fields that disagree, for the world the run will have
    files it reads                         datasets, tokenizer, init_from, checkpoint.resume
    checkpoint.dir                         takes a file and has room for one more checkpoint
    resumable (launchers)                  the newest checkpoint can be resumed by some model

Each command asks for what it can check where it runs: `setdiff recipe validate` writes nothing,
a dry run renders anywhere, a SLURM submission checks for the compute nodes' GPUs.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from setdiff_megatron.checkpoint.publish import check_writable
from setdiff_megatron.checkpoint.resolve import resume_target
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.recipes import Recipe, RecipeError, validate_recipe
from setdiff_megatron.recipes.validation import estimated_model_config
from setdiff_megatron.training.rewards import reward_function

__all__ = ["check_run", "run_model_config", "CHECKPOINT_BYTES_PER_PARAM"]

CHECKPOINT_BYTES_PER_PARAM = 16
"""Saved bytes per parameter, with margin: weights, fp32 main copy, two Adam moments."""


def check_run(
    recipe: Recipe,
    source: str | Path,
    *,
    world_size: int | None = None,
    has_gpu: bool | None = None,
    files: bool = True,
    checkpoint_dir: bool = True,
    resumable: bool = False,
) -> None:
    """Raise the first problem as one line naming `source` (the recipe file). `world_size` None
    is the recipe's launch size; `files` checks what the run reads; `checkpoint_dir` probes the
    run directory with a write (so `recipe validate` leaves it off); `resumable` is for a
    launcher, which refuses once what every process would refuse."""
    model_config = run_model_config(recipe, files)
    errors = validate_recipe(
        recipe,
        world_size=world_size,
        has_gpu=has_gpu,
        check_paths=files,
        model_config=model_config,
        recipe_file=source,
    )
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise RecipeError(f"{source}: {errors[0]}{more}")
    if files and recipe.rl is not None:
        try:
            reward_function(recipe.rl.reward)  # imported now: a typo fails before any process starts
        except UserError as exc:
            raise RecipeError(f"{source}: {exc}") from None
    if checkpoint_dir:
        check_writable(Path(recipe.checkpoint.dir), model_config.num_params() * CHECKPOINT_BYTES_PER_PARAM)
    if resumable:
        _check_resumable(recipe)


def run_model_config(recipe: Recipe, files: bool = True) -> ModelConfig:
    """The run's model as far as it is known before any process starts, built once for every
    check that sizes it: with the tokenizer's vocabulary where the recipe names one (and files
    may be read)."""
    vocab = None
    if files and recipe.data.tokenizer is not None and Path(recipe.data.tokenizer).exists():
        from setdiff_megatron.data.tokenizers import load_tokenizer

        vocab = load_tokenizer(recipe.data.tokenizer).vocab_size
    return estimated_model_config(recipe, vocab)


def _check_resumable(recipe: Recipe) -> None:
    """Quiet: the run itself reports the checkpoints it skips. `none` is the run's to do, as it
    moves checkpoints. The newest checkpoint is hashed here in one process and again by the
    ranks: a second read of its files, the price of refusing before any process starts."""
    c = recipe.checkpoint
    if c.resume != "none":
        with contextlib.redirect_stdout(io.StringIO()):
            resume_target(Path(c.dir), c.resume, None)
