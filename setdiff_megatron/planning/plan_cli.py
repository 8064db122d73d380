"""`setdiff plan RECIPE [overrides] --gpus N [--gpu NAME]`: the recipe's plan on N GPUs, or with
--search the plans of every layout of N GPUs the recipe's rules allow, fastest fitting first."""

from __future__ import annotations

import argparse
import dataclasses

from setdiff_megatron.errors import UserError
from setdiff_megatron.log import say
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.planning.devices import DEVICES, device
from setdiff_megatron.recipes.schema import Recipe

__all__ = ["add_parser", "plan_model_config"]


def add_parser(sub, add_recipe_args) -> None:
    plan = sub.add_parser(
        "plan",
        help="what a recipe needs on N GPUs: memory per rank, FLOPs, step time, KV cache",
        description="Build the recipe's model, optimizer and buffers as each pipeline stage's most "
        "loaded rank would, under fake tensors and a fake process group of N ranks, run one training "
        "step, and report memory, FLOPs, a step-time lower bound and the sampler's KV cache "
        "(docs/scaling.md). Runs on a CPU.",
    )
    add_recipe_args(plan)
    plan.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    plan.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(DEVICES)} (default h100-80gb)")
    plan.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU, for a device not listed")
    plan.add_argument("--gpu-tflops", type=float, default=None, help="dense BF16 TFLOP/s, for a device not listed")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--margin", type=float, default=0.1, help="memory kept free (default 0.1: 10 %%)")
    plan.add_argument(
        "--vocab-size", type=int, default=None, help="the tokenizer's vocabulary, where it is not on this machine"
    )
    plan.add_argument("--search", action="store_true", help="plan every layout of the GPUs the recipe allows")
    plan.set_defaults(func=run)


def plan_model_config(recipe: Recipe, vocab_size: int | None) -> ModelConfig:
    """The model planned: the recipe's, with `vocab_size`, else as preflight estimates the run's
    (its tokenizer's vocabulary where that is on this machine, else the recipe's); MASK is the
    last token."""
    from setdiff_megatron.recipes.validation import estimated_model_config
    from setdiff_megatron.training.preflight import run_model_config

    cfg = estimated_model_config(recipe, vocab_size) if vocab_size else run_model_config(recipe)
    return dataclasses.replace(cfg, mask_token_id=cfg.vocab_size - 1)


def run(args: argparse.Namespace) -> int:
    from setdiff_megatron.distributed.megatron_cpu import prepare_megatron_import
    from setdiff_megatron.planning.plan import make_plan, plan_recipe, search_layouts
    from setdiff_megatron.recipes.recipe_files import load_recipe

    prepare_megatron_import()
    gpu = device(args.gpu, memory_gib=args.gpu_memory, tflops=args.gpu_tflops)
    if not 0 <= args.margin < 1:
        raise UserError(f"--margin must lie in [0, 1); got {args.margin}")
    recipe = load_recipe(args.recipe, args.overrides)
    cfg = plan_model_config(recipe, args.vocab_size)
    options = dict(gpus_per_node=args.gpus_per_node, margin=args.margin)
    if not args.search:
        say(plan_recipe(recipe, cfg, args.gpus, gpu, **options).report())
        return 0
    candidates = search_layouts(recipe, cfg, args.gpus)
    if not candidates:
        raise UserError(f"no layout of {args.gpus} GPUs passes {recipe.name}'s rules")
    plans = [make_plan(c, cfg, args.gpus, gpu, **options) for c in candidates]
    plans.sort(key=lambda p: (not p.fits, -p.tokens_per_second))
    for p in plans:
        say(p.summary())
    return 0
