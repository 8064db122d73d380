"""A full megatron-engine optimizer step in one process, for the throughput benchmarks.

The megatron engine of `setdiff train`, built from a recipe: model, optimizer and pipeline-schedule
step; gloo and the CPU layer without a GPU, NCCL with one.
"""

from __future__ import annotations

from collections.abc import Callable

from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.recipes import Recipe


def megatron_step(
    recipe_dict: dict, *, vocab_size: int, mask_token_id: int, batches: list[TwoStreamBatch]
) -> tuple[Callable[[], None], ModelConfig]:
    """(a closure running one optimizer step over `batches`, the model config). The process
    joins the job's group as `setdiff train` does (a world of one without a launcher)."""
    from setdiff_megatron.training.engines.megatron_engine import MegatronEngine

    recipe = Recipe.model_validate(recipe_dict)
    engine = MegatronEngine(recipe)
    cfg = recipe.model.to_model_config(vocab_size=vocab_size, mask_token_id=mask_token_id)
    engine.build(cfg, recipe.train.steps)

    def step() -> None:
        engine.forward_backward(batches)
        engine.optimizer_step()

    return step, cfg
