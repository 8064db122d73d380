"""What the DeepSpeed engine is told, derived from a recipe: DeepSpeed's JSON config and the optimizer.

The update rule is the megatron engine's, so that one recipe trains the same model under both:
torch's AdamW (or SGD) over megatron-core's parameter groups, never DeepSpeed's own fused
optimizers, and megatron's fp16 loss scaling (docs/training.md, "DeepSpeed engine").
`deepspeed_config` is a pure function of the recipe and the data-parallel size, so it is tested
without DeepSpeed; `build_optimizer` imports megatron-core.
"""

from __future__ import annotations

import torch
from torch import nn

from setdiff_megatron.recipes.schema import Recipe
from setdiff_megatron.training.lr_schedule import scheduled_weight_decay

__all__ = ["deepspeed_config", "param_groups", "build_optimizer"]

# megatron-core's fp16 loss scaling (OptimizerConfig): initial 2**32, window 1000, hysteresis 2.
FP16_LOSS_SCALING = {
    "loss_scale": 0,
    "initial_scale_power": 32,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def deepspeed_config(recipe: Recipe, dp_size: int) -> dict:
    """DeepSpeed's config for this recipe on `dp_size` data-parallel processes."""
    p, t = recipe.parallel, recipe.train
    zero: dict = {"stage": p.zero_stage}
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_batch_size": p.global_batch_size,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.global_batch_size // (p.micro_batch_size * dp_size),
        "gradient_clipping": t.clip_grad,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", **FP16_LOSS_SCALING},
        # The optimizer is torch's, also when its state is offloaded: DeepSpeed's fused ones need
        # compiled ops and would step differently (docs/training.md, "DeepSpeed engine").
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": None,  # metrics.py reports progress
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16":
        # Accumulate gradients over micro-batches in fp32, as megatron's main_grad buffers do.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def param_groups(model: nn.Module, *, decay_all: bool = False) -> list[dict]:
    """megatron-core's default groups over the trainable parameters (frozen ones, under LoRA, go
    to no optimizer): 1-D parameters (norms) and biases take no weight decay; with `decay_all`
    one group of every parameter (composer's DecoupledAdamW). `wd_mult` is what
    OptimizerParamScheduler multiplies the weight decay by. Empty groups are left out."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if decay_all:
        return [{"params": [p for _, p in trained], "wd_mult": 1.0}]
    no_decay = {n for n, p in trained if p.dim() == 1 or n.endswith(".bias")}
    groups = [
        {"params": [p for n, p in trained if n not in no_decay], "wd_mult": 1.0},
        {"params": [p for n, p in trained if n in no_decay], "wd_mult": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(recipe: Recipe, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer megatron-core builds on its torch path (decoupled weight decay for Adam), or
    composer's DecoupledAdamW as lr_schedule.py sets it up."""
    from megatron.core.optimizer import OptimizerConfig

    t = recipe.train
    if t.optimizer != "sgd":
        groups = param_groups(model, decay_all=t.optimizer == "decoupled_adamw")
        return torch.optim.AdamW(groups, lr=t.lr, weight_decay=scheduled_weight_decay(recipe), betas=t.betas, eps=t.eps)
    # OptimizerConfig.sgd_momentum is a dataclass default: megatron's momentum, read from megatron.
    return torch.optim.SGD(
        param_groups(model), lr=t.lr, weight_decay=t.weight_decay, momentum=OptimizerConfig.sgd_momentum
    )
