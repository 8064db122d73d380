"""Where converted weights come from: every source is (config, torch state dict, tokenizer, recipe).

  megatron   a checkpoint of the megatron engine, any TP/PP layout (training/checkpoint_reader.py)
  deepspeed  a checkpoint of the DeepSpeed engine (training/deepspeed_checkpointing.py's
             consolidated_state_dict), where that engine is installed
  setdiff    a Hugging Face export of ours (model_type setdiff; hf/load.py)
  llama, qwen2, qwen3   a Hugging Face causal LM to adapt (hf/ar_import.py)

Converters, `model.init_from` and the sampler all read through `read_source`, so a new source
format is one reader here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.data.tokenizers import SetDiffTokenizer, load_tokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.hf.ar_import import SUPPORTED, ar_model_config, ar_state_dict, supported_text
from setdiff_megatron.hf.weights_io import load_safetensors_dir
from setdiff_megatron.models.config import ModelConfig

__all__ = ["Source", "read_source", "read_hf_dir", "read_hf_config", "AR_KINDS"]

AR_KINDS = tuple(SUPPORTED)


@dataclass
class Source:
    kind: str
    """'megatron', 'deepspeed', 'setdiff' or an AR model type ('llama', 'qwen2', 'qwen3')."""
    path: Path
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    """Torch model names (models/torch_model.py)."""
    tokenizer: SetDiffTokenizer
    recipe: Any | None = None
    """The training recipe (megatron/DeepSpeed checkpoints), else None."""
    step: int | None = None
    layout: dict | None = None

    def describe(self) -> str:
        what = {"megatron": "megatron checkpoint", "deepspeed": "DeepSpeed checkpoint",
                "setdiff": "set diffusion Hugging Face export"}.get(self.kind, f"{self.kind} causal LM")
        extra = f", step {self.step}" if self.step is not None else ""
        if self.layout:
            extra += f", saved at tp {self.layout.get('tp')} pp {self.layout.get('pp')}"
        return f"{what} {self.path}{extra}"


def read_hf_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


def _hf_tokenizer(directory: Path, *, add_missing_tokens: bool) -> SetDiffTokenizer:
    has_files = any((directory / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer.model"))
    if not has_files:
        raise UserError(f"{directory} has no tokenizer (tokenizer.json); the conversion needs it to fix the "
                        "MASK token and to ship the tokenizer with the weights")
    return load_tokenizer(directory, add_missing_tokens=add_missing_tokens)


def read_hf_dir(directory: str | Path) -> Source:
    """A Hugging Face directory: our export, or a Llama/Qwen2/Qwen3 causal LM."""
    directory = Path(directory)
    config = read_hf_config(directory)
    if config.get("model_type") == "setdiff":
        from setdiff_megatron.hf.load import load_hf_export

        cfg, state, tokenizer = load_hf_export(directory)
        return Source("setdiff", directory, cfg, state, tokenizer)
    if config.get("model_type") not in SUPPORTED:
        arch = (config.get("architectures") or [config.get("model_type")])[0]
        raise UserError(f"{directory}: architecture {arch!r} is not supported; supported: {supported_text()}")
    tokenizer = _hf_tokenizer(directory, add_missing_tokens=True)
    rows = int(config.get("vocab_size") or 0)
    cfg = ar_model_config(config, directory, vocab_size=max(rows, tokenizer.vocab_size), mask_token_id=tokenizer.mask_id)
    cfg, state = ar_state_dict(load_safetensors_dir(directory), cfg, tokenizer, directory)
    return Source(config["model_type"], directory, cfg, state, tokenizer)


def _deepspeed_step(path: Path) -> Path | None:
    """The step directory `path` names if it is a checkpoint of the DeepSpeed engine, else None."""
    from setdiff_megatron.training.checkpoint_reader import resolve_checkpoint

    try:
        from setdiff_megatron.training.deepspeed_checkpointing import TAG
    except ImportError:  # an installation without the DeepSpeed engine
        return None
    from setdiff_megatron.training.checkpointing import CHECKPOINTS, LATEST, TRAIN_STATE, find_checkpoints

    guess = path  # the step directory a resolution would pick, found without hashing anything
    if not (path / TRAIN_STATE).is_file():
        root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
        named = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
        guess = root / named if named else next(iter(find_checkpoints(root)), path)
    return resolve_checkpoint(path) if (guess / TAG).is_dir() else None


def _deepspeed_source(step_dir: Path) -> Source:
    from setdiff_megatron.recipes import load_recipe
    from setdiff_megatron.recipes.loading import RESOLVED_NAME
    from setdiff_megatron.training.checkpoint_reader import _model_config
    from setdiff_megatron.training.checkpointing import TRAIN_STATE
    from setdiff_megatron.training.deepspeed_checkpointing import consolidated_state_dict
    from setdiff_megatron.models.weight_maps import torch_shapes

    saved = json.loads((step_dir / TRAIN_STATE).read_text())
    recipe = load_recipe(step_dir / RESOLVED_NAME)
    if not (step_dir / "tokenizer").is_dir():
        raise UserError(f"checkpoint {step_dir} has no tokenizer/ directory; it cannot be exported")
    tokenizer = load_tokenizer(step_dir / "tokenizer", add_missing_tokens=False)
    config = _model_config(saved, recipe, step_dir)  # noqa: SLF001 - the reader's config rule, shared
    state = consolidated_state_dict(step_dir)
    shapes = torch_shapes(config)
    bad = sorted(set(shapes) ^ set(state)) + [k for k in shapes if k in state and tuple(state[k].shape) != shapes[k]]
    if bad:
        raise UserError(f"checkpoint {step_dir} does not match its recorded model config: {bad[:5]}")
    return Source("deepspeed", step_dir, config, state, tokenizer, recipe, saved["step"], saved["layout"])


def read_source(path: str | Path) -> Source:
    """Weights, config and tokenizer from any supported source (see the module docstring)."""
    from setdiff_megatron.training.checkpoint_reader import is_megatron_checkpoint, read_checkpoint

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist")
    if is_megatron_checkpoint(path) and (step_dir := _deepspeed_step(path)) is not None:
        return _deepspeed_source(step_dir)
    if is_megatron_checkpoint(path):
        ckpt = read_checkpoint(path)
        return Source("megatron", ckpt.path, ckpt.config, ckpt.state_dict, ckpt.tokenizer, ckpt.recipe,
                      ckpt.step, ckpt.layout)
    if (path / "config.json").is_file():
        return read_hf_dir(path)
    raise UserError(f"{path} is neither a megatron checkpoint (train_state.json, or a run directory with "
                    "checkpoints/latest) nor a Hugging Face directory (config.json)")
