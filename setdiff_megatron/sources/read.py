"""`read_source(path)`: weights, config and tokenizer from anything a model can be read from.

Our run directories of either engine at any layout, our Hugging Face exports, Llama/Qwen causal
LMs to adapt, and the reference's DiT checkpoints and SetDLM releases (`read_source` lists them).
Sampling, the evaluation jobs (infilling included), `setdiff convert`, `model.init_from` and the
lm-eval adapter all read through it, so a new source format is one reader here. `fit_source` is
the rule for starting a model from a source's weights (`model.init_from`): the same tokenizer,
the same architecture.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.checkpoint.identity import config_from_identity
from setdiff_megatron.checkpoint.names import TOKENIZER_DIR, is_checkpoint_path
from setdiff_megatron.checkpoint.resolve import resolve_step_dir
from setdiff_megatron.checkpoint.state import read_train_state
from setdiff_megatron.core.orders import LeftToRight
from setdiff_megatron.data.tokenizers import SetDiffTokenizer, load_tokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.lora import merge_adapters
from setdiff_megatron.models.weight_maps.torch_layout import torch_shapes
from setdiff_megatron.recipes import Recipe, load_recipe
from setdiff_megatron.recipes.inputs import where_looked
from setdiff_megatron.recipes.recipe_files import RESOLVED_NAME
from setdiff_megatron.recipes.schema import MethodSection
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sources.ar_import import SUPPORTED, ar_model_config, ar_state_dict, unsupported_architecture
from setdiff_megatron.sources.base_model import BASE_ENV
from setdiff_megatron.sources.deepspeed_checkpoints import consolidated_state_dict, is_deepspeed_checkpoint
from setdiff_megatron.sources.dit_import import DIT_KIND, dit_state_dict, is_dit_config, read_composer_checkpoint
from setdiff_megatron.sources.hf_export import export_policy, load_hf_export, read_hf_config
from setdiff_megatron.sources.hf_files import load_safetensors_dir
from setdiff_megatron.sources.megatron_checkpoints import adapter_weights, torch_weights
from setdiff_megatron.sources.setdlm_release import RELEASE_KIND, is_release_config, read_release

__all__ = ["Source", "read_source", "read_hf_dir", "fit_source", "AR_KINDS"]

AR_KINDS = tuple(SUPPORTED)
RUN_KINDS = ("megatron", "deepspeed")
_RELEASE_FAMILIES = {"set_diffusion": "SetDLM", "mdlm": "MDLM", "bd3lm": "BD3LM"}
"""A reference release's architecture, by the family its recipe records."""


@dataclass
class Source:
    kind: str
    """'megatron', 'deepspeed', 'setdiff', 'dit' or an AR model type ('llama', 'qwen2', 'qwen3', 'qwen3_moe')."""
    path: Path
    """The step directory read (runs), the Hugging Face directory, or the composer .pt file."""
    config: ModelConfig
    state_dict: dict[str, torch.Tensor] | None
    """Torch model names (models/torch_model.py), in the saved dtype; None when read without weights."""
    tokenizer: SetDiffTokenizer
    recipe: Recipe | None = None
    """The training recipe (runs), the settings a SetDLM release is evaluated with, else None."""
    step: int | None = None
    layout: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    """What the reader ignored, one line each (a release's source files, its attention backend,
    what a safe unpickling dropped)."""
    method: MethodSection | None = None
    """What it was trained as where no recipe says (an export of a baseline records its family,
    block size and sequence length in config.json); see `family`."""
    length: int | None = None
    """The sequence length it was trained on where no recipe says (see `trained_length`)."""
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    """The model's own decoding policy, where every sampling entry point starts: its recipe's (runs,
    releases), its generation_config.json (our exports), one token per step (causal LMs); the
    sampler's defaults where nothing records one (a bare DiT)."""
    averaged: bool = False
    """The weights are the run's average of them (train.ema_decay), which a checkpoint that holds
    one gives every reader, as the reference evaluates and releases its EMA."""

    @property
    def family(self) -> str:
        """The model family, which decides its forward and sampler (sampling/samplers.py):
        'set_diffusion', or the baselines 'mdlm' and 'bd3lm'."""
        method = self.method or (self.recipe.method if self.recipe is not None else None)
        return method.family if method is not None else "set_diffusion"

    @property
    def block_size(self) -> int | None:
        """BD3-LM's block size (None for the other families)."""
        method = self.method or (self.recipe.method if self.recipe is not None else None)
        return method.block_size if method is not None and method.family == "bd3lm" else None

    @property
    def trained_length(self) -> int:
        """The rows it was trained on (recipe data.seq_len): the window a baseline decodes over."""
        if self.recipe is not None:
            return self.recipe.data.seq_len
        return self.length or self.config.max_seq_len

    @property
    def lora(self) -> bool:
        """A run with model.lora: its checkpoints hold adapters alone, which the reader merges
        into the weights of its model.init_from."""
        return self.kind in RUN_KINDS and self.recipe is not None and self.recipe.model.lora is not None

    @property
    def add_bos(self) -> bool:
        """The training data started each sample with a clean BOS (recipe method.keep_clean_bos)."""
        return self.recipe is not None and self.recipe.method.keep_clean_bos

    def describe(self) -> str:
        what = {
            "megatron": "megatron checkpoint",
            "deepspeed": "DeepSpeed checkpoint",
            "setdiff": "set diffusion Hugging Face export",
            DIT_KIND: "reference DiT checkpoint",
            RELEASE_KIND: f"reference {_RELEASE_FAMILIES[self.recipe.method.family] if self.recipe else 'SetDLM'} release",
        }.get(self.kind, f"{self.kind} causal LM")
        extra = f", step {self.step}" if self.step is not None else ""
        if self.layout and self.kind == "megatron":
            extra += f", saved at tp {self.layout.get('tp')} pp {self.layout.get('pp')}"
        if self.averaged:
            extra += ", EMA weights"
        return f"{what} {self.path}{extra}"


def _read_run(path: Path, weights: bool) -> Source:
    step_dir = resolve_step_dir(path)
    state = read_train_state(step_dir)
    recipe = load_recipe(step_dir / RESOLVED_NAME)
    if not (step_dir / TOKENIZER_DIR).is_dir():
        raise UserError(
            f"checkpoint {step_dir} has no {TOKENIZER_DIR}/ directory; it cannot encode prompts or be exported"
        )
    tokenizer = load_tokenizer(step_dir / TOKENIZER_DIR, add_missing_tokens=False)
    config = config_from_identity(
        state.model, attention_impl=recipe.model.attention_impl, init_std=recipe.model.init_std
    )
    kind = "deepspeed" if is_deepspeed_checkpoint(step_dir) else "megatron"
    averaged = state.ema is not None
    state_dict = None
    if weights and recipe.model.lora is not None:
        adapters = adapter_weights(step_dir) if kind == "megatron" else consolidated_state_dict(step_dir)
        state_dict = _merged(step_dir, recipe, config, tokenizer, adapters)
    elif weights and kind == "megatron":
        state_dict = torch_weights(step_dir, config, ema=averaged)
    elif weights:
        state_dict = consolidated_state_dict(step_dir, ema=averaged)
        shapes = torch_shapes(config)
        bad = sorted(set(shapes) ^ set(state_dict)) + [
            k for k in shapes if k in state_dict and tuple(state_dict[k].shape) != shapes[k]
        ]
        if bad:
            raise UserError(f"checkpoint {step_dir} does not match its recorded model config: {bad[:5]}")
    return Source(
        kind,
        step_dir,
        config,
        state_dict,
        tokenizer,
        recipe,
        state.progress.step,
        state.layout,
        decoding=recipe.decoding_policy(),
        averaged=averaged,
    )


def _merged(
    step_dir: Path, recipe: Recipe, config: ModelConfig, tokenizer: SetDiffTokenizer, adapters: dict
) -> dict[str, torch.Tensor]:
    """A LoRA run's weights: its adapters merged into its base, model.init_from read again
    (through read_source: a base that is itself a LoRA run merges its own adapters first)."""
    base = Path(recipe.model.init_from)  # a relative one was looked for as a recipe's inputs are
    if not base.exists():
        raise UserError(
            f"checkpoint {step_dir} holds LoRA adapters on model.init_from {base}, which is not found"
            f"{where_looked(str(base), step_dir / RESOLVED_NAME)}: read it from the directory it trained in"
        )
    where = f"the LoRA base (model.init_from) of {step_dir},"
    start = fit_source(read_source(base), config, tokenizer, where)
    try:
        return merge_adapters(start, adapters, recipe.model.lora.spec(), config)
    except KeyError as exc:
        raise UserError(
            f"checkpoint {step_dir} does not hold the adapters its recipe's model.lora names: {exc}"
        ) from None


def _hf_tokenizer(directory: Path) -> SetDiffTokenizer:
    if not any((directory / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        raise UserError(
            f"{directory} has no tokenizer (tokenizer.json); the conversion needs it to fix the "
            "MASK token and to ship the tokenizer with the weights"
        )
    return load_tokenizer(directory, add_missing_tokens=True)


def read_hf_dir(directory: str | Path, *, weights: bool = True, base: str | Path | None = None) -> Source:
    """A Hugging Face directory: our export, a Llama/Qwen2/Qwen3/Qwen3-MoE causal LM, the
    reference's DiT (its PyTorchModelHubMixin config.json and model.safetensors) or one of its
    SetDLM releases (`base`, else $SETDIFF_BASE_MODEL: the local base model a Qwen3 release names)."""
    directory = Path(directory)
    config = read_hf_config(directory)
    if config.get("model_type") == "setdiff":
        cfg, state, tokenizer = load_hf_export(directory)
        return Source(
            "setdiff",
            directory,
            cfg,
            state if weights else None,
            tokenizer,
            method=_export_method(config),
            length=config.get("length"),
            decoding=export_policy(directory),
        )
    if is_release_config(config):
        tokenizer = _hf_tokenizer(directory)
        base = base or os.environ.get(BASE_ENV) or None
        cfg, state, release = read_release(directory, config, tokenizer, base=Path(base) if base else None)
        recipe = release.recipe(cfg)
        return Source(
            RELEASE_KIND,
            directory,
            cfg,
            state if weights else None,
            tokenizer,
            recipe,
            notes=release.notes,
            decoding=recipe.decoding_policy(),
        )
    if is_dit_config(config):
        tokenizer = _hf_tokenizer(directory)
        cfg, state = dit_state_dict(load_safetensors_dir(directory), config, tokenizer, directory)
        return Source(DIT_KIND, directory, cfg, state if weights else None, tokenizer)
    if config.get("model_type") not in SUPPORTED:
        raise unsupported_architecture(config, directory)
    tokenizer = _hf_tokenizer(directory)
    rows = int(config.get("vocab_size") or 0)
    cfg = ar_model_config(
        config, directory, vocab_size=max(rows, tokenizer.vocab_size), mask_token_id=tokenizer.mask_id
    )
    cfg, state = ar_state_dict(load_safetensors_dir(directory), cfg, tokenizer, directory)
    return Source(
        config["model_type"],
        directory,
        cfg,
        state if weights else None,
        tokenizer,
        decoding=DecodingConfig(**LeftToRight().decoding_policy().settings()),
    )


def _export_method(config: dict) -> MethodSection | None:
    """A baseline's family and block size, as our exporter records them in config.json."""
    if config.get("family", "set_diffusion") == "set_diffusion":
        return None
    try:
        return MethodSection(family=config["family"], block_size=config.get("block_size"))
    except ValueError as exc:
        raise UserError(f"config.json: family {config['family']!r} is not a model family: {exc}") from None


def read_source(path: str | Path, *, weights: bool = True, base: str | Path | None = None) -> Source:
    """Weights (unless not `weights`), config and tokenizer from any of these (`base`: read_hf_dir):

      megatron   a run directory (its newest valid checkpoint) or step directory, any TP/PP layout
      deepspeed  a run directory or step directory of the DeepSpeed engine, any ZeRO stage
      setdiff    a Hugging Face export of ours (model_type setdiff)
      llama, qwen2, qwen3, qwen3_moe   a Hugging Face causal LM to adapt (ar_import.py)
      dit        the reference's DiT (dit_import.py): a PyTorchModelHubMixin directory or composer .pt
      setdlm     a SetDLM release (setdlm_release.py) on a DiT, or on a Qwen3 whose base `base` names
    A run gives its weight average where it kept one (train.ema_decay); a LoRA run, its adapters
    merged into its model.init_from weights."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"model source {path} does not exist")
    if is_checkpoint_path(path):
        return _read_run(path, weights)
    if (path / "config.json").is_file():
        return read_hf_dir(path, weights=weights, base=base)
    if path.is_file() and path.suffix == ".pt":
        return _read_composer(path, weights)
    raise UserError(
        f"{path} is neither a setdiff checkpoint (a run directory with checkpoints/latest, or a step_* "
        "directory with train_state.json), a Hugging Face directory (config.json) nor a composer .pt "
        "checkpoint of the reference's DiT"
    )


def _read_composer(path: Path, weights: bool) -> Source:
    beside = read_hf_config(path.parent) if (path.parent / "config.json").is_file() else None
    cfg, state, tokenizer, notes = read_composer_checkpoint(path, beside, lambda: _hf_tokenizer(path.parent))
    return Source(DIT_KIND, path, cfg, state if weights else None, tokenizer, notes=notes)


_FREE = ("vocab_size", "max_seq_len", "attention_impl", "init_std")


def fit_source(
    source: Source, model_cfg: ModelConfig, tokenizer: SetDiffTokenizer, where: str = "model.init_from"
) -> dict[str, torch.Tensor]:
    """The source's torch weights fitted to `model_cfg`, or a UserError naming what differs.

    The tokenizer must be the one the weights were trained with (compared by sha256).
    Architecture fields must match; max_seq_len may differ (rotary positions carry no weights),
    and so may vocab_size where only rows beyond the tokenizer's vocabulary differ: those are
    dropped, or added with the mean embedding."""
    if source.tokenizer.sha256 != tokenizer.sha256:
        theirs, ours = source.tokenizer, tokenizer
        hint = f"{source.path}/{TOKENIZER_DIR}" if source.kind in RUN_KINDS else str(source.path)
        raise UserError(
            f"{where} {source.path}: its tokenizer differs from data.tokenizer's (vocabulary {theirs.vocab_size} vs "
            f"{ours.vocab_size}, MASK id {theirs.mask_id} vs {ours.mask_id}); set data.tokenizer to the tokenizer "
            f"saved with it ({hint})"
        )
    ours, theirs = asdict(model_cfg), asdict(source.config)
    diffs = [
        f"model.{k} is {ours[k]} in the recipe, {theirs[k]} there"
        for k in ours
        if k not in _FREE and ours[k] != theirs[k]
    ]
    if diffs:
        raise UserError(f"{where} {source.path} is another model: {'; '.join(diffs)}")
    state = dict(source.state_dict)
    rows, want = source.config.vocab_size, model_cfg.vocab_size
    if rows != want:
        if min(rows, want) < tokenizer.vocab_size:
            raise UserError(
                f"{where} {source.path} has {rows} vocabulary rows and the recipe {want}; both must cover "
                f"the tokenizer's {tokenizer.vocab_size} tokens"
            )
        names = (
            ("embed_tokens.weight",)
            + (() if model_cfg.tie_embeddings else ("lm_head.weight",))
            + (("lm_head.bias",) if model_cfg.output_bias else ())
        )
        for name in names:
            w = state[name]
            mean = w[: tokenizer.vocab_size].float().mean(0, keepdim=True).to(w.dtype)
            state[name] = w[:want] if rows > want else torch.cat([w, mean.expand(want - rows, *w.shape[1:])])
    return state
