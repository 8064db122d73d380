"""The DeepSpeed engine's weights on disk, read whole in one process for sampling, export and
`model.init_from`.

    step_00000300/deepspeed/   engine.save_checkpoint(tag="deepspeed"): model states and, under
                               ZeRO, each rank's optimizer partition (at stage 3 its weights too)
    step_00000300/ema.pt       with train.ema_decay: the average of the weights, whole, fp32
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from setdiff_megatron.checkpoint.ema_files import read_whole
from setdiff_megatron.checkpoint.manifest import verify
from setdiff_megatron.checkpoint.names import DEEPSPEED_TAG as TAG
from setdiff_megatron.checkpoint.state import read_train_state
from setdiff_megatron.errors import UserError, require

__all__ = ["is_deepspeed_checkpoint", "consolidated_state_dict"]


def is_deepspeed_checkpoint(step_dir: Path) -> bool:
    return (Path(step_dir) / TAG).is_dir()


def _bf16_optimizer_weights(ds_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 master weights of DeepSpeed's BF16_Optimizer (what it runs for ZeRO-1 with bf16
    weights and fp32 gradient accumulation), whose files zero_to_fp32 does not read. Each
    param group is its parameters flattened in order, padded at the end and cut into one equal
    partition per rank; the model-states file names the parameters and their shapes."""
    from deepspeed.utils.tensor_fragment import fragment_address

    shapes = torch.load(ds_dir / "mp_rank_00_model_states.pt", weights_only=True)["param_shapes"]
    files = sorted(
        ds_dir.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=lambda f: int(f.name.split("_")[4])
    )
    with torch.serialization.safe_globals([fragment_address]):
        partitions = [
            torch.load(f, weights_only=True)["optimizer_state_dict"]["single_partition_of_fp32_groups"] for f in files
        ]
    weights = {}
    for group, group_shapes in enumerate(shapes):
        flat = torch.cat([parts[group] for parts in partitions])
        offset = 0
        for name, shape in group_shapes.items():
            weights[name] = flat[offset : offset + shape.numel()].view(shape).clone()
            offset += shape.numel()
    return weights


def consolidated_state_dict(checkpoint_dir: str | Path, *, ema: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a DeepSpeed-engine checkpoint (module docstring) under the torch
    model's parameter names, in this process, without torch.distributed: the fp32 master weights
    under ZeRO 1-3, the model's own weights at stage 0; with `ema` the average of the weights it
    holds (train.ema_decay), which the engine writes whole. Refuses an incomplete checkpoint (sizes
    against its manifest; docs/training.md, "DeepSpeed engine")."""
    directory = Path(checkpoint_dir)
    problem = verify(directory, checksums=False)
    if problem:
        raise UserError(f"cannot read {directory}: {problem}")
    if not is_deepspeed_checkpoint(directory):
        raise UserError(f"{directory} is not a checkpoint of the deepspeed engine (no {TAG}/ folder in it)")
    if ema:
        return read_whole(directory)
    saved = read_train_state(directory).layout
    if saved["zero_stage"] == 0:
        module = torch.load(directory / TAG / "mp_rank_00_model_states.pt", weights_only=True)["module"]
        return {name: tensor.float() for name, tensor in module.items()}
    require("deepspeed", "deepspeed", f"Reading the ZeRO-{saved['zero_stage']} checkpoint {directory}")
    if saved["optimizer"] == "BF16_Optimizer":
        return _bf16_optimizer_weights(directory / TAG)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32 calls torch.load(weights_only=False) itself (its ZeRO optimizer files pickle a
    # ZeroStageEnum and a LossScaler object): that is why the files are checked against the manifest first.
    # zero_to_fp32 narrates its work (prints and a progress bar); a reader has nothing to add.
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
