"""The engines a recipe picks with `engine:`, behind one base class (base.py). Each module imports
its framework (megatron-core, DeepSpeed) when the engine is built, not before."""

from __future__ import annotations

from setdiff_megatron.recipes import Recipe
from setdiff_megatron.training.engines.base import Engine, StepOutcome

__all__ = ["Engine", "StepOutcome", "start_engine"]


def start_engine(recipe: Recipe) -> Engine:
    """The recipe's engine, with its process groups up (collective: every rank calls it)."""
    if recipe.engine == "megatron":
        from setdiff_megatron.training.engines.megatron_engine import MegatronEngine

        return MegatronEngine(recipe)
    from setdiff_megatron.training.engines.deepspeed_engine import DeepSpeedEngine

    return DeepSpeedEngine(recipe)
