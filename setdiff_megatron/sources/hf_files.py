"""Reading Hugging Face weight files: sharded safetensors with an index, never pickle.

Reading takes `model.safetensors`, or `model.safetensors.index.json` and the shards it names;
a directory holding only pickled weights (pytorch_model.bin, *.pt) is refused, never loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from setdiff_megatron.errors import UserError, require

__all__ = ["SINGLE", "INDEX", "safetensors", "load_safetensors_dir", "safetensors_dtype"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


def safetensors():
    return require("safetensors.torch", "hf", "Reading and writing Hugging Face weights")


def _weight_files(directory: Path) -> list[Path]:
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise UserError(f"{directory / INDEX} is not a safetensors index ({exc})") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{directory} lacks the weight shards {missing} named by {INDEX}")
        return files
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    pickled = [n for n in _PICKLED if (directory / n).is_file()]
    if pickled:
        raise UserError(
            f"{directory} holds only pickled weights ({', '.join(pickled)}); only safetensors are "
            "read (no pickle). Convert them once with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise UserError(f"{directory} has no {SINGLE} or {INDEX}")


def load_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors weights (the index's shards or the
    single file); a name stored twice is an error."""
    st = safetensors()
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(directory)):
        try:
            part = st.load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise UserError(f"cannot read {file}: {exc}") from None
        twice = sorted(set(part) & set(out))
        if twice:
            raise UserError(f"{file} repeats tensors of another shard: {twice[:5]}")
        out |= part
    return out


def safetensors_dtype(state_dict: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype of the weights (float32 if they mix several)."""
    dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32
