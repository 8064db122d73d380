"""Writing Hugging Face weight files and output directories: sharded safetensors with an index
(no pickle), and a staging directory renamed into place only when complete. Reading them is
sources/hf_files.py's."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from setdiff_megatron.errors import UserError
from setdiff_megatron.sources.hf_files import INDEX, safetensors

__all__ = ["parse_size", "save_sharded", "staged_directory"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in _UNITS:
        raise UserError(f"shard size must look like 5GB, 500MB or 2GiB; got {text!r}")
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size < 1:
        raise UserError(f"shard size must be positive; got {text!r}")
    return size


def save_sharded(state_dict: Mapping[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> list[str]:
    """Shards of at most max_shard_bytes (a larger tensor gets a shard of its own), in name order,
    plus model.safetensors.index.json; returns the shard file names."""
    st = safetensors()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state_dict):
        tensor = state_dict[name].contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        st.save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in shard}
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


@contextlib.contextmanager
def staged_directory(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """A fresh sibling directory to write into, renamed to `out` when the block succeeds and
    removed when it fails: nothing half-written ever sits at `out`. An existing `out` is refused
    unless `overwrite`, and then replaced only at the end."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.with_name(f"{out.name}.partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        aside = out.with_name(f"{out.name}.replaced")
        shutil.rmtree(aside, ignore_errors=True)
        out.rename(aside)
        stage.rename(out)
        shutil.rmtree(aside)
    else:
        stage.rename(out)
