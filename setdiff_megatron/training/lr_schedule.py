"""The learning-rate and weight-decay schedule of both engines: megatron-core's
OptimizerParamScheduler with the recipe's warmup, decay style and minimum, so the DeepSpeed
engine steps through exactly the LRs the megatron engine does.

Both engines step torch's AdamW (megatron-core's CPU path; TE's and Apex's fused Adam on GPUs
update alike), which shrinks each weight by lr_t x its group's weight decay before the Adam
update. train.optimizer 'adamw' hands it train.weight_decay (megatron's rule); 'decoupled_adamw'
hands it weight_decay / lr, so weights shrink by (lr_t / lr) x weight_decay: composer's
DecoupledAdamW, whose decay follows the schedule's factor and not the LR itself."""

from __future__ import annotations

import math

from setdiff_megatron.recipes.schema import Recipe

__all__ = ["build_lr_scheduler", "scheduled_weight_decay", "total_steps"]


def total_steps(recipe: Recipe) -> int:
    """Optimizer steps of a run: train.steps, or train.tokens over the global batch's tokens."""
    if recipe.train.steps is not None:
        return recipe.train.steps
    return math.ceil(recipe.train.tokens / (recipe.parallel.global_batch_size * recipe.data.seq_len))


def scheduled_weight_decay(recipe: Recipe) -> float:
    """The weight decay AdamW's param groups get, which it multiplies by lr_t (module docstring)."""
    t = recipe.train
    return t.weight_decay / t.lr if t.optimizer == "decoupled_adamw" else t.weight_decay


def build_lr_scheduler(recipe: Recipe, optimizer, total_steps: int):
    """megatron-core's scheduler with the megatron engine's arguments. It sets every param
    group's LR and weight decay at construction (step 0) and at each `step(increment=1)`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = recipe.train
    warmup = min(t.warmup_steps, total_steps - 1)  # megatron needs warmup < decay steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=total_steps,
        lr_decay_style={"wsd": "WSD"}.get(t.schedule, t.schedule),
        start_wd=scheduled_weight_decay(recipe),
        end_wd=scheduled_weight_decay(recipe),
        wd_incr_steps=total_steps,
        wd_incr_style="constant",
        wsd_decay_steps=max(1, int(t.decay_fraction * total_steps)) if t.schedule == "wsd" else None,
        lr_wsd_decay_style="linear" if t.schedule == "wsd" else None,
        # The recipe's schedule wins over a resumed checkpoint's; the checkpoint gives the step.
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
