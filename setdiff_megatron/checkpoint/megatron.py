"""The megatron engine's weights on disk: dist_checkpointing shards, written by the ranks of any
TP/PP layout and read back at any other, or whole in one process.

dist_checkpointing's `torch_dist` format is PyTorch distributed checkpointing (DCP) underneath,
and every model tensor is stored at its global shape: layers stacked on a leading axis, QKV and
MLP rows in TP=1 order, experts in global order, the vocabulary padded. So `torch_weights`
reads any layout in one process without megatron: a DCP load of the global tensors, renamed into
one TP = PP = EP = 1 chunk, then `weight_maps.megatron_to_torch`. Tensor data is read
with `torch.load(weights_only=True)` by DCP; its `.metadata` file is a pickle, which is why a
checkpoint's files are checked against its sha256 manifest before anything is read.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps import MEGATRON_LAYER, megatron_to_torch

__all__ = ["torch_weights", "model_sharded_state", "save_shards", "load_shards", "load_model_shard"]

_STACKED = MEGATRON_LAYER.format("").rstrip(".")  # "decoder.layers": one tensor per weight, layers first
_CHECKPOINT_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                     "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
"""megatron stores the norms under Transformer Engine's fused names whatever the backend."""
_STACKED_EXPERTS = ".mlp.experts.experts."
"""An MoE layer's experts are stored as one tensor per weight, experts first."""
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""The canonical per-parameter format of the distributed optimizer: reshardable over TP/PP/DP."""


def _global_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint at its global shape (optimizer state and TE's
    `_extra_state` bytes are not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.items()
             if isinstance(meta, TensorStorageMetadata) and "optimizer" not in key.split(".")[:2]}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _local_chunk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's global tensors as one TP = PP = EP = 1 chunk of the local backend: layers
    unstacked (a dense model's are stacked; an MoE model's are stored one by one), norms under
    their local names, each MoE layer's stacked experts split into local experts."""
    out = {}
    for key, tensor in state.items():
        suffix = key[len(_STACKED) + 1:]
        if key.startswith(_STACKED + ".") and not suffix.split(".")[0].isdigit():
            out |= {MEGATRON_LAYER.format(i) + suffix: layer for i, layer in enumerate(tensor.unbind(0))}
        else:
            out[key] = tensor
    renamed = {}
    for key, tensor in out.items():
        for stored, local in _CHECKPOINT_NORMS.items():
            if key.endswith(stored):
                key = key.removesuffix(stored) + local
        if _STACKED_EXPERTS in key:
            layer, name = key.split(_STACKED_EXPERTS)
            renamed |= {f"{layer}.mlp.experts.local_experts.{e}.{name}": w for e, w in enumerate(tensor.unbind(0))}
        else:
            renamed[key] = tensor
    return renamed


def torch_weights(step_dir: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The torch model's weights of a megatron checkpoint of any layout, in one process."""
    megatron = _local_chunk(_global_tensors(step_dir))
    try:
        return megatron_to_torch({(0, 0): megatron}, config, backend="local")
    except (KeyError, ValueError) as exc:
        raise UserError(f"checkpoint {step_dir} does not match its recorded model config: {exc}") from None


def model_sharded_state(modules, optimizer=None, *, is_loading: bool = False) -> dict:
    """Model chunks (bare megatron modules) and, unless None, their optimizer as one
    dist_checkpointing state dict."""
    model = {f"model{i}": m.sharded_state_dict(prefix="") for i, m in enumerate(modules)}
    if optimizer is None:
        return model
    # The optimizer's shards are keyed by the model's sharded tensors, found by parameter.
    return {**model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                               metadata=OPTIMIZER_METADATA)}


def save_shards(state: dict, directory: Path) -> None:
    """Collective: every rank writes its shards of `state` (model_sharded_state) to `directory`."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, str(directory))


def load_shards(state: dict, directory: Path) -> dict:
    """Collective: this rank's shards of `state`, from a checkpoint of any layout."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(state, str(directory))


def load_model_shard(module, step_dir: Path) -> None:
    """Load this rank's shard of a megatron model chunk from `step_dir` (sampling at TP > 1)."""
    loaded = load_shards(model_sharded_state([module], is_loading=True), step_dir)
    module.load_state_dict(loaded["model0"])
