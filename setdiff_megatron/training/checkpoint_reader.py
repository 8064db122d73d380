"""Read a published megatron checkpoint in ONE process, without megatron: for sampling, export
and evaluation.

dist_checkpointing's `torch_dist` format is PyTorch distributed checkpointing (DCP) underneath,
and every model tensor is stored at its global shape: layers stacked on a leading axis, QKV and
MLP rows in TP=1 order, the vocabulary padded. So the weights of any TP/PP/DP layout come back
by a DCP load of the global tensors into one process, then `weight_maps.megatron_to_torch` as
for a single TP=1, PP=1 chunk. megatron writes the norm weights under Transformer Engine's names
(`linear_qkv.layer_norm_weight`) whatever the backend, hence the `te` map. Tensor data is read
with `torch.load(weights_only=True)` by DCP; its `.metadata` file is a pickle, which is why the
files are checked against the checkpoint's sha256 manifest before anything is read.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from setdiff_megatron.data.tokenizers import SetDiffTokenizer, load_tokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps import MEGATRON_LAYER, megatron_to_torch
from setdiff_megatron.recipes import Recipe, load_recipe
from setdiff_megatron.recipes.loading import RESOLVED_NAME
from setdiff_megatron.training.checkpointing import CHECKPOINTS, LATEST, TRAIN_STATE, find_checkpoints, verify

__all__ = ["TrainedCheckpoint", "resolve_checkpoint", "read_checkpoint", "is_megatron_checkpoint"]

_STACKED = MEGATRON_LAYER.format("").rstrip(".")  # "decoder.layers": one tensor per weight, layers first


@dataclass
class TrainedCheckpoint:
    path: Path
    """The step directory that was read."""
    step: int
    config: ModelConfig
    state_dict: dict[str, torch.Tensor] | None
    """The torch model's weights (models/torch_model.py names), in the dtype they were saved in;
    None when read without weights."""
    tokenizer: SetDiffTokenizer
    recipe: Recipe
    layout: dict
    """The parallel layout it was saved from (tp, pp, vpp, dp, ...)."""


def is_megatron_checkpoint(path: str | Path) -> bool:
    """A step directory, a run's checkpoints/ folder or a run directory of the megatron engine."""
    path = Path(path)
    return (path / TRAIN_STATE).is_file() or (path / LATEST).is_file() or (path / CHECKPOINTS / LATEST).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory `path` names: itself, or the newest valid one of a run (`latest` first)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if (path / TRAIN_STATE).is_file():
        problem = verify(path, collective=False)
        if problem:
            raise UserError(f"checkpoint {path} is not usable: {problem}")
        return path
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    latest = root / LATEST
    candidates = find_checkpoints(root)
    if latest.is_file():
        named = root / latest.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for candidate in candidates:
        if verify(candidate, collective=False) is None:
            return candidate
    if candidates:
        raise UserError(f"no valid checkpoint under {root}: {verify(candidates[0], collective=False)}")
    raise UserError(f"{path} holds no checkpoint (no {TRAIN_STATE}, no {CHECKPOINTS}/{LATEST}); "
                    "pass a run directory (checkpoint.dir) or one of its step_* directories")


def _model_config(saved: dict, recipe: Recipe, path: Path) -> ModelConfig:
    identity = saved.get("model")
    if identity is None:
        raise UserError(f"{path / TRAIN_STATE} records no model config (saved by an older setdiff); retrain or "
                        "re-save it with this version")
    known = {f.name for f in fields(ModelConfig)}
    extra = {"attention_impl": recipe.model.attention_impl, "init_std": recipe.model.init_std}
    return ModelConfig(**{k: v for k, v in (identity | extra).items() if k in known}).resolved()


def _global_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint at its global shape (optimizer state and TE's
    `_extra_state` bytes are not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.items()
             if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _unstack_layers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state.items():
        if key.startswith(_STACKED + "."):
            suffix = key[len(_STACKED) + 1:]
            out |= {MEGATRON_LAYER.format(i) + suffix: layer for i, layer in enumerate(tensor.unbind(0))}
        else:
            out[key] = tensor
    return out


def _torch_weights(step_dir: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    megatron = _unstack_layers(_global_tensors(step_dir))
    try:
        return megatron_to_torch({(0, 0): megatron}, config, backend="te")
    except (KeyError, ValueError) as exc:
        raise UserError(f"checkpoint {step_dir} does not match its recorded model config: {exc}") from None


def read_checkpoint(path: str | Path, *, weights: bool = True) -> TrainedCheckpoint:
    """Weights, config, tokenizer and recipe of a checkpoint (a run directory takes its newest).
    Without `weights`, a caller loads them itself (each TP rank its own shard, through
    dist_checkpointing) from the returned `path`."""
    step_dir = resolve_checkpoint(path)
    saved = json.loads((step_dir / TRAIN_STATE).read_text())
    recipe = load_recipe(step_dir / RESOLVED_NAME)
    if not (step_dir / "tokenizer").is_dir():
        raise UserError(f"checkpoint {step_dir} has no tokenizer/ directory; it cannot encode prompts or be exported")
    tokenizer = load_tokenizer(step_dir / "tokenizer", add_missing_tokens=False)
    config = _model_config(saved, recipe, step_dir)
    state_dict = _torch_weights(step_dir, config) if weights else None
    return TrainedCheckpoint(path=step_dir, step=saved["step"], config=config, state_dict=state_dict,
                             tokenizer=tokenizer, recipe=recipe, layout=saved["layout"])
