"""The megatron engine's shards on disk: dist_checkpointing's collective save and load, written
by the ranks of any TP/PP layout and read back at any other (`sources/megatron_checkpoints.py` reads them
whole in one process, without megatron).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.checkpoint.ema_files import average_shards, empty_averages, load_averaged

__all__ = ["model_sharded_state", "save_shards", "load_shards", "load_model_shard"]

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""The canonical per-parameter format of the distributed optimizer: reshardable over TP/PP/DP."""


def model_sharded_state(
    modules, optimizer=None, *, is_loading: bool = False, keep: Callable[[str], bool] | None = None
) -> dict:
    """Model chunks (bare megatron modules) and, unless None, their optimizer as one
    dist_checkpointing state dict; with `keep`, only the model entries whose keys it keeps (LoRA's
    adapters: models/lora.py)."""
    model = {f"model{i}": m.sharded_state_dict(prefix="") for i, m in enumerate(modules)}
    # The optimizer's shards are keyed by the model's sharded tensors, found by parameter.
    state = (
        {"optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=OPTIMIZER_METADATA)}
        if optimizer is not None
        else {}
    )
    if keep is not None:
        model = {chunk: {k: v for k, v in part.items() if keep(k)} for chunk, part in model.items()}
    return model | state


def save_shards(state: dict, directory: Path, *, background: bool = False) -> Any:
    """Collective: every rank writes its shards of `state` (model_sharded_state) to `directory`.
    With `background` the shards are written by a forked process (a copy-on-write snapshot of
    the weights as they are now): returns dist_checkpointing's AsyncRequest to schedule, whose
    finalize functions complete the checkpoint once every rank's shards are on disk."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.save(state, str(directory), async_sharded_save=background)


def load_shards(state: dict, directory: Path) -> dict:
    """Collective: this rank's shards of `state`, from a checkpoint of any layout."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(state, str(directory))


def load_model_shard(module, step_dir: Path, *, ema: bool = False) -> None:
    """Load this rank's shard of a megatron model chunk from `step_dir` (sampling at TP > 1): its
    weights, or with `ema` the checkpoint's average of them (cast to the module's dtype)."""
    state = model_sharded_state([module], is_loading=True)
    if ema:
        state |= average_shards(state, empty_averages(module.parameters()))
    loaded, averages = load_averaged(state, lambda s: load_shards(s, step_dir))
    module.load_state_dict(loaded["model0"])
    with torch.no_grad():
        for p in module.parameters():
            if id(p) in averages:
                p.copy_(averages[id(p)])
