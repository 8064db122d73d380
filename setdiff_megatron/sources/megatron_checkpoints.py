"""The megatron engine's checkpoints read whole in one process, without megatron, for sampling,
export and `model.init_from`.

dist_checkpointing's `torch_dist` format is PyTorch distributed checkpointing (DCP) underneath,
and every model tensor is stored at its global shape: layers stacked on a leading axis, QKV and
MLP rows in TP=1 order, experts in global order, the vocabulary padded. So `torch_weights`
reads any layout: a DCP load of the global tensors, renamed into one TP = PP = EP = 1 chunk,
then `weight_maps.megatron_map.megatron_to_torch`. A checkpoint of a run with train.ema_decay also
holds the average of the weights, sharded as they are (checkpoint/ema_files.py). Tensor data is read with
`torch.load(weights_only=True)` by DCP; its `.metadata` file is a pickle, which is why a
checkpoint's files are checked against its sha256 manifest before anything is read.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from setdiff_megatron.checkpoint.ema_files import stored_keys, under_weight_keys
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.megatron_map import MEGATRON_LAYER, megatron_to_torch

__all__ = ["torch_weights", "adapter_weights"]

_STACKED = MEGATRON_LAYER.format("").rstrip(".")  # "decoder.layers": one tensor per weight, layers first
_CHECKPOINT_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
"""megatron stores the norms under Transformer Engine's fused names whatever the backend."""
_STACKED_EXPERTS = ".mlp.experts.experts."
"""An MoE layer's experts are stored as one tensor per weight, experts first."""


def _global_tensors(path: Path, *, ema: bool) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint at its global shape (optimizer state and TE's
    `_extra_state` bytes are not read): the weights, or with `ema` their average where the
    checkpoint holds one (every parameter), under the weights' keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        key: meta
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata) and "optimizer" not in key.split(".")[:2]
    }
    state = {
        key: torch.empty(tensors[key].size, dtype=tensors[key].properties.dtype)
        for key in stored_keys(tensors, ema=ema)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return under_weight_keys(state)


def _local_chunk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's global tensors as one TP = PP = EP = 1 chunk of the local backend: layers
    unstacked (a dense model's are stacked; an MoE model's are stored one by one), norms under
    their local names, each MoE layer's stacked experts split into local experts."""
    out = {}
    for key, tensor in state.items():
        suffix = key[len(_STACKED) + 1 :]
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


def torch_weights(step_dir: Path, config: ModelConfig, *, ema: bool = False) -> dict[str, torch.Tensor]:
    """The torch model's weights of a megatron checkpoint of any layout, in one process; with `ema`
    the average of the weights it holds (train.ema_decay), in fp32."""
    megatron = _local_chunk(_global_tensors(step_dir, ema=ema))
    try:
        return megatron_to_torch(megatron, config, backend="local")
    except (KeyError, ValueError) as exc:
        raise UserError(f"checkpoint {step_dir} does not match its recorded model config: {exc}") from None


def adapter_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The LoRA adapters (models/lora.py) a checkpoint of a run with model.lora holds in place of
    weights, under the torch model's names (their tensors are the same under both bodies)."""
    return {
        "layers." + key.removeprefix(_STACKED + "."): t
        for key, t in _local_chunk(_global_tensors(step_dir, ema=False)).items()
    }
