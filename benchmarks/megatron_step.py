"""A full megatron-engine optimizer step in one process, for the throughput benchmarks.

Builds the model, optimizer and pipeline-schedule step exactly as `setdiff train` does (from a
recipe), in a world of one process: gloo and the CPU layer without a GPU, NCCL with one.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.recipes import Recipe


def _init_world_of_one() -> None:
    from setdiff_megatron.training.megatron_cpu import auto_cpu_mode, dist_backend, model_parallel_seed

    auto_cpu_mode()
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group(dist_backend(), rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_seed(0)


def megatron_step(recipe_dict: dict, *, vocab_size: int, mask_token_id: int,
                  batches: list[TwoStreamBatch]) -> tuple[Callable[[], None], ModelConfig]:
    """(a closure running one optimizer step over `batches`, the model config)."""
    from setdiff_megatron.training.megatron_engine import TrainStep, build_model, build_optimizer, quiet_known_warnings

    quiet_known_warnings()
    _init_world_of_one()
    recipe = Recipe.model_validate(recipe_dict)
    cfg = recipe.model.to_model_config(vocab_size=vocab_size, mask_token_id=mask_token_id)
    _, chunks = build_model(recipe, cfg)
    optimizer, _ = build_optimizer(recipe, chunks, recipe.train.steps)
    step_fn = TrainStep(recipe, chunks)

    def step() -> None:
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        step_fn(batches, forward_only=False)
        optimizer.step()

    return step, cfg
