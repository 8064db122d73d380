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
from setdiff_megatron.recipes import Recipe, RecipeError, validate_recipe

__all__ = ["check_run", "CHECKPOINT_BYTES_PER_PARAM"]

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
    errors = validate_recipe(recipe, world_size=world_size, has_gpu=has_gpu, check_paths=files, recipe_file=source)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise RecipeError(f"{source}: {errors[0]}{more}")
    if checkpoint_dir:
        _check_checkpoint_room(recipe)
    if resumable:
        _check_resumable(recipe)


def _check_checkpoint_room(recipe: Recipe) -> None:
    vocab = recipe.data.vocab_size
    if recipe.data.tokenizer is not None:
        from setdiff_megatron.data.tokenizers import load_tokenizer

        vocab = load_tokenizer(recipe.data.tokenizer).vocab_size
    params = recipe.model.to_model_config(vocab_size=vocab, mask_token_id=0).num_params()
    check_writable(Path(recipe.checkpoint.dir), params * CHECKPOINT_BYTES_PER_PARAM)


def _check_resumable(recipe: Recipe) -> None:
    """Quiet: the run itself reports the checkpoints it skips. `none` is the run's to do, as it
    moves checkpoints. The newest checkpoint is hashed here in one process and again by the
    ranks: a second read of its files, the price of refusing before any process starts."""
    c = recipe.checkpoint
    if c.resume != "none":
        with contextlib.redirect_stdout(io.StringIO()):
            resume_target(Path(c.dir), c.resume, None)
