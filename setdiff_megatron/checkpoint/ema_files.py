"""The average of the weights (train.ema_decay) on disk: its names, and every read and write of it.

The megatron engine's is shards beside the weights', under EMA_PREFIX + each tensor's key, so it
reshards as they do; the DeepSpeed engine's is whole in EMA_FILE (fp32, torch names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch

__all__ = [
    "EMA_FILE",
    "EMA_PREFIX",
    "write_whole",
    "read_whole",
    "average_shards",
    "empty_averages",
    "load_averaged",
    "stored_keys",
    "under_weight_keys",
]

EMA_FILE = "ema.pt"
"""The DeepSpeed engine's average of the weights: fp32, under torch model names."""
EMA_PREFIX = "ema."
"""The megatron engine's average of the weights: its shards beside the model's, each under the
model tensor's key with this prefix."""


def write_whole(directory: Path, averages: dict[str, torch.Tensor]) -> None:
    """Write the whole average (torch names, fp32) into a checkpoint `directory`."""
    torch.save(averages, directory / EMA_FILE)


def read_whole(directory: Path) -> dict[str, torch.Tensor]:
    """The whole average a DeepSpeed-engine checkpoint holds, under torch names."""
    return torch.load(directory / EMA_FILE, weights_only=True)


def average_shards(model_state: dict, wholes: dict[int, torch.Tensor]) -> dict:
    """The average as megatron shards beside the model's, to save or to load into.

    Each sharded tensor of `model_state` (checkpoint/megatron_shards.py) whose data is a parameter with a
    whole average in `wholes` (by its id) is copied with that average (fp32) as data, under
    EMA_PREFIX + its key; "ema<i>" holds chunk i's, keyed as "model<i>" is."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for chunk, sharded in model_state.items():
        if not chunk.startswith("model"):
            continue
        part = {}
        for key, sh in sharded.items():
            if isinstance(sh, ShardedTensorFactory) and id(sh.data) in wholes:
                part[key] = replace(sh, key=EMA_PREFIX + sh.key, data=wholes[id(sh.data)])
            elif isinstance(sh, ShardedTensor) and id(sh.data) in wholes:
                part[key] = replace(sh, key=EMA_PREFIX + sh.key, data=wholes[id(sh.data)], dtype=torch.float32)
        out[f"ema{chunk.removeprefix('model')}"] = part
    return out


def empty_averages(params: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Whole averages to load into: one empty fp32 tensor per parameter, by the parameter's id."""
    return {id(p): torch.empty(p.shape, dtype=torch.float32) for p in params}


def load_averaged(state: dict, load: Callable[[dict], dict]) -> tuple[dict, dict[int, torch.Tensor]]:
    """Load `state` with `load`, and each parameter's loaded whole average by its id.

    `load` is the collective shard load; the ids are taken from `state`'s model shards before the
    load replaces them."""
    owners = {
        (part, key): id(state[f"model{part.removeprefix('ema')}"][key].data)
        for part in state
        if part.startswith("ema")
        for key in state[part]
    }
    loaded = load(state)
    return loaded, {owner: loaded[part][key] for (part, key), owner in owners.items()}


def stored_keys(keys: Iterable[str], *, ema: bool) -> list[str]:
    """The keys of a megatron checkpoint's tensors to read for its weights.

    With `ema` the average's where the checkpoint holds one, the model's elsewhere."""
    keys = list(keys)
    averaged = {key.removeprefix(EMA_PREFIX) for key in keys if key.startswith(EMA_PREFIX)} if ema else set()
    return [key for key in keys if (ema if key.startswith(EMA_PREFIX) else key not in averaged)]


def under_weight_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors read under stored_keys, keyed as the weights are."""
    return {key.removeprefix(EMA_PREFIX): tensor for key, tensor in state.items()}
