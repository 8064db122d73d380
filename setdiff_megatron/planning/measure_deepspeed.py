"""One rank's memory in one training step of the DeepSpeed engine, measured under `LiveBytes`.

As planning/measure.py does for the megatron engine: `deepspeed.initialize` makes ZeRO's flat
buffers, partitions and optimizer state as in training, and the micro-batches run forward and
backward through DeepSpeed's gradient hooks (ZeRO-2's reduce bucket, ZeRO-3's parameter gathers);
the optimizer's update is left out. What fake tensors cannot run is stood in for
(`_under_fake_tensors`; docs/scaling.md, "How each figure is made").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.planning.live_bytes import LiveBytes
from setdiff_megatron.planning.measure import RankMemory, synthetic_batch
from setdiff_megatron.recipes.schema import Recipe

__all__ = ["measure_deepspeed_rank"]


@contextlib.contextmanager
def _under_fake_tensors() -> Iterator[FakeTensorMode]:
    """Fake tensors, their parameters moved by setting data, DeepSpeed's copy of the world group
    made anew in this fake world (it keeps the first one it makes), and ZeRO-3's check that every
    rank traced the same parameters passed (it reads rank 0's ids on the host; one rank is planned,
    so they are the same)."""
    from deepspeed.runtime.zero import partition_parameters, partitioned_param_coordinator, stage3
    from deepspeed.utils import groups

    same_everywhere = [
        mock.patch.object(module, "assert_ints_same_as_other_ranks", lambda ints: None)
        for module in (partition_parameters, partitioned_param_coordinator, stage3)
        if hasattr(module, "assert_ints_same_as_other_ranks")
    ]

    # torch moves a parameter by swapping tensors, which fake tensors refuse (the fake mode holds weak
    # references to them); setting its data is what torch does for real parameters.
    def set_data(param: torch.Tensor, moved: torch.Tensor) -> None:
        with torch.no_grad():
            param.data = moved.data

    with (
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
        mock.patch.object(torch.utils, "swap_tensors", set_data),
        mock.patch.object(groups, "_WORLD_GROUP", None),
        contextlib.ExitStack() as stack,
    ):
        for patch in same_everywhere:
            stack.enter_context(patch)
        yield mode


def _held_as_fake(batch: TwoStreamBatch, mode: FakeTensorMode) -> TwoStreamBatch:
    """The batch's tensors as fake ones held for the whole step, as the real ones are: converted
    at each use instead, they would be counted and freed at every use."""
    tensors = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(
        batch, **{k: mode.from_tensor(v) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    )


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO's, BF16_Optimizer)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def measure_deepspeed_rank(recipe: Recipe, model_cfg: ModelConfig, *, fake: bool) -> RankMemory:
    """This rank's footprint over one step (a process group of the recipe's world must be up).
    params: the module's parameters as ZeRO holds them on this rank; optimizer: the rest of what
    `deepspeed.initialize` keeps (fp32 partitions, moments; ZeRO-3's buffers); grads: what the
    backward leaves (ZeRO's fp32 gradient partition, or whole gradients at ZeRO-0)."""
    from setdiff_megatron.training.engines.base import fill_torch_optimizer_state
    from setdiff_megatron.training.engines.deepspeed_engine import DeepSpeedEngine

    if recipe.parallel.offload_optimizer:
        raise UserError(
            "setdiff plan does not plan parallel.offload_optimizer (the host holds the optimizer's state); "
            "plan the recipe with parallel.offload_optimizer=false for the GPU's side without the offload"
        )
    engine = DeepSpeedEngine(recipe)
    batch = synthetic_batch(recipe, model_cfg)
    mbs = recipe.parallel.micro_batch_size
    num_micro = recipe.parallel.global_batch_size // (mbs * engine.dp_size)
    tracker = LiveBytes()
    with _under_fake_tensors() if fake else contextlib.nullcontext() as mode, tracker:
        if fake:
            batch = _held_as_fake(batch, mode)
        engine.build(model_cfg, total_steps=1)
        wrapped = engine.engine  # deepspeed.initialize
        fill_torch_optimizer_state(_torch_optimizer(wrapped.optimizer))  # DeepSpeed fills it at ZeRO 1-3
        # ZeRO-1/2 parameters are views of one flat buffer; ZeRO-3 keeps each one's shard in ds_tensor.
        held = [getattr(p, "ds_tensor", p).untyped_storage() for p in wrapped.module.parameters()]
        params = sum({id(s): s.nbytes() for s in held}.values())
        static = tracker.current
        tracker.reset_peak()
        batches = [batch] * num_micro
        # Loss scale 1, not the global batch's token count: the count is data, and the scale moves no memory.
        engine.backward_micro_batches(batches, [engine.objective(b) for b in batches], 1.0)
        grads = tracker.current - static
        peak = tracker.peak
        num_params = sum(getattr(p, "ds_numel", p.numel()) for p in wrapped.module.parameters())
    return RankMemory(params, grads, static - params, peak, num_params, model_cfg.num_layers, num_micro)
