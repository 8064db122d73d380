"""Checkpoints of the DeepSpeed engine: DeepSpeed's own format inside the published, verified
layout of checkpointing.py.

    step_00000300/
      deepspeed/             engine.save_checkpoint(tag="deepspeed"): model states and, under
                             ZeRO, each rank's optimizer partition (at stage 3 its weights too)
      zero_to_fp32.py ...    DeepSpeed's offline consolidation scripts (ZeRO stages only)
      rank_00000.pt ...      per-rank RNG states (python, numpy, torch, CUDA)
      train_state.json       step, consumed samples, LR scheduler, layout (engine, ZeRO stage,
                             optimizer wrapper), the resolved model config and tokenizer identity
      recipe.yaml  tokenizer/  manifest.json     as the megatron engine writes them
    latest

Publication (a temporary directory, a manifest hashed by all ranks, an atomic rename, `latest`,
retention), verification, `resume: auto` and the model-identity check are checkpointing.py's.
DeepSpeed loads partitioned optimizer state only on the ZeRO stage and data-parallel size it was
saved with, so a resume on another layout is refused; `consolidated_state_dict` gives the
weights to start over from.

Loading and weights_only: our files (RNG states, stage-0 model states, BF16_Optimizer
partitions with DeepSpeed's fragment_address allowed) load with weights_only=True. DeepSpeed's
own loaders (engine.load_checkpoint, zero_to_fp32) call torch.load(weights_only=False)
themselves: their ZeRO optimizer files pickle a ZeroStageEnum and a LossScaler object.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes import Recipe
from setdiff_megatron.training import checkpointing
from setdiff_megatron.training.checkpointing import TRAIN_STATE, TrainState

__all__ = ["save", "resume_target", "load", "consolidated_state_dict", "TAG"]

TAG = "deepspeed"
# Keys of the layout that DeepSpeed's own format must find unchanged to load.
LOADABLE_ON = ("zero_stage", "dp", "optimizer")


def layout(recipe: Recipe, engine) -> dict:
    """checkpointing.layout's keys (so `setdiff checkpoint inspect` reads it; ZeRO >= 1 is a
    distributed optimizer), plus what DeepSpeed's format depends on."""
    stage = recipe.parallel.zero_stage
    return {**checkpointing.layout(recipe), "distributed_optimizer": stage >= 1, "engine": "deepspeed",
            "zero_stage": stage, "offload_optimizer": recipe.parallel.offload_optimizer,
            "optimizer": type(engine.optimizer).__name__}


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.pt"


def save(recipe: Recipe, engine, scheduler, state: TrainState, tokenizer) -> Path:
    """Collective: every rank calls it. Returns the published checkpoint directory."""
    run_layout = layout(recipe, engine)

    def write(tmp: Path) -> None:
        engine.save_checkpoint(str(tmp), tag=TAG, save_latest=False)
        torch.save(checkpointing.host_rng_state(), _rng_file(tmp, dist.get_rank()))
        if dist.get_rank() == 0:
            checkpointing.write_run_files(tmp, recipe, state, scheduler, tokenizer, run_layout)

    return checkpointing.save_with(recipe, state.step, write)


def _refusal(path: Path, saved: dict, here: dict) -> str | None:
    if saved.get("engine") != "deepspeed":
        return (f"{path} was written by the megatron engine; the deepspeed engine resumes only its own "
                "checkpoints: use engine: megatron or a new checkpoint.dir")
    changed = [f"{k} {saved[k]} there, {here[k]} here" for k in LOADABLE_ON if saved[k] != here[k]]
    if changed:
        return (f"{path} has another DeepSpeed layout ({'; '.join(changed)}); DeepSpeed loads its partitioned "
                "optimizer state only on the layout it was saved with: restore parallel.zero_stage, "
                "the process count and train.precision, or start a new run from its consolidated weights")
    return None


def resume_target(recipe: Recipe, tokenizer) -> Path | None:
    """Collective: the checkpoint that `checkpoint.resume` selects, as the megatron engine selects
    it. Known before the engine is built, which decides whether `model.init_from` applies."""
    return checkpointing._resume_target(recipe, checkpointing._model_identity(recipe, tokenizer))


def load(path: Path, recipe: Recipe, engine, scheduler, state: TrainState) -> None:
    """Load checkpoint `path` into the freshly built objects, or refuse with the reason."""
    saved = json.loads((path / TRAIN_STATE).read_text())
    problem = _refusal(path, saved["layout"], layout(recipe, engine))
    if problem:
        raise UserError(f"checkpoint.resume: cannot load {problem}")
    # The LR schedule is the recipe's (its scheduler takes only the step count from the checkpoint).
    loaded, _ = engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True,
                                       load_lr_scheduler_states=False)
    if loaded is None:
        raise UserError(f"checkpoint.resume: DeepSpeed found no checkpoint in {path / TAG}")
    scheduler.load_state_dict(saved["scheduler"])
    for key in asdict(state):
        setattr(state, key, saved[key])
    checkpointing.set_host_rng_state(torch.load(_rng_file(path, dist.get_rank()), weights_only=True))


def _bf16_optimizer_weights(ds_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 master weights of DeepSpeed's BF16_Optimizer (what it runs for ZeRO-1 with bf16
    weights and fp32 gradient accumulation), whose files zero_to_fp32 does not read. Each
    param group is its parameters flattened in order, padded at the end and cut into one equal
    partition per rank; the model-states file names the parameters and their shapes."""
    from deepspeed.utils.tensor_fragment import fragment_address

    shapes = torch.load(ds_dir / "mp_rank_00_model_states.pt", weights_only=True)["param_shapes"]
    files = sorted(ds_dir.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda f: int(f.name.split("_")[4]))
    with torch.serialization.safe_globals([fragment_address]):
        partitions = [torch.load(f, weights_only=True)["optimizer_state_dict"]["single_partition_of_fp32_groups"]
                      for f in files]
    weights = {}
    for group, group_shapes in enumerate(shapes):
        flat = torch.cat([parts[group] for parts in partitions])
        offset = 0
        for name, shape in group_shapes.items():
            weights[name] = flat[offset:offset + shape.numel()].view(shape).clone()
            offset += shape.numel()
    return weights


def consolidated_state_dict(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a DeepSpeed-engine checkpoint under the torch model's parameter
    names, in this process (no torch.distributed): the fp32 master weights under ZeRO 1-3, the
    model's own weights at stage 0. Refuses an incomplete checkpoint (sizes against its
    manifest; `checkpointing.verify` also checks the sha256 sums)."""
    directory = Path(checkpoint_dir)
    problem = checkpointing.verify(directory, checksums=False, collective=False)
    if problem:
        raise UserError(f"cannot read {directory}: {problem}")
    if not (directory / TAG).is_dir():
        raise UserError(f"{directory} is not a checkpoint of the deepspeed engine (no {TAG}/ folder in it)")
    saved = json.loads((directory / TRAIN_STATE).read_text())["layout"]
    if saved["zero_stage"] == 0:
        module = torch.load(directory / TAG / "mp_rank_00_model_states.pt", weights_only=True)["module"]
        return {name: tensor.float() for name, tensor in module.items()}
    if saved["optimizer"] == "BF16_Optimizer":
        return _bf16_optimizer_weights(directory / TAG)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
