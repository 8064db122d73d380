"""The reference implementation's DiT checkpoints (the paper's OpenWebText and LM1B models) as
weights of the set diffusion model family in its DiT layout (models/config.py `DIT_BODY`).

Two forms: its Hub directory (config.json of the backbone's constructor arguments,
model.safetensors read by hf_files.py, the tokenizer) and a composer .pt training checkpoint, a
pickle read by safe_pickle.py so that no code of the file runs. With adaln: true the time
embedding and modulations come too. docs/dit.md, "Importing the released checkpoints", describes
both forms and what is refused.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.data.tokenizers import SetDiffTokenizer, load_tokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import DIT_BODY, ModelConfig
from setdiff_megatron.models.torch_model import Rotary
from setdiff_megatron.models.weight_maps.dit import DIT_ROTARY, dit_to_torch
from setdiff_megatron.models.weight_maps.torch_layout import add_vocabulary_rows
from setdiff_megatron.sources.safe_pickle import load_pickle

__all__ = ["DIT_KIND", "ComposerParts", "dit_state_dict", "is_dit_config", "read_composer_checkpoint"]

DIT_KIND = "dit"
_HUB_KEYS = frozenset({"hidden_size", "n_heads", "num_layers", "vocab_size", "length", "adaln", "causal_attention"})
"""Constructor arguments of the reference's DIT that its config.json always holds."""
_TOKENIZER_FILES = (".json", ".txt")


def is_dit_config(config: Mapping[str, Any]) -> bool:
    """Whether a config.json (or a denoiser's backbone_config) describes the reference's DiT."""
    return _HUB_KEYS <= config.keys()


def _model_config(backbone: Mapping[str, Any], where: Path, mask_token_id: int) -> ModelConfig:
    adaln = bool(backbone.get("adaln"))
    if adaln and backbone.get("cond_dim") is None:
        raise UserError(f"{where}: adaln: true without its cond_dim; the DiT's config.json holds both")
    if backbone.get("causal_attention"):
        raise UserError(
            f"{where}: causal_attention: true is the reference's autoregressive baseline, not a set diffusion model"
        )
    try:
        return ModelConfig(
            vocab_size=int(backbone["vocab_size"]),
            mask_token_id=mask_token_id,
            hidden_size=int(backbone["hidden_size"]),
            num_layers=int(backbone["num_layers"]),
            num_heads=int(backbone["n_heads"]),
            max_seq_len=int(backbone["length"]),
            adaln=adaln,
            **({"adaln_cond_dim": int(backbone["cond_dim"])} if adaln else {}),
            **DIT_BODY,
        )
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: not a valid DiT config: {exc}") from None


def dit_state_dict(
    weights: Mapping[str, torch.Tensor], backbone: Mapping[str, Any], tokenizer: SetDiffTokenizer, where: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The ModelConfig and torch weights of a DiT's backbone weights (its own names) and config.
    The tokenizer's MASK must be a row of the checkpoint's embedding; token ids beyond its rows
    (tokens the tokenizer loader adds) get mean rows, as the Llama/Qwen imports do."""
    rows = int(backbone["vocab_size"])
    if not 0 <= tokenizer.mask_id < rows:
        raise UserError(
            f"{where}: the tokenizer's MASK {tokenizer.special_tokens['mask']!r} (id {tokenizer.mask_id}) "
            f"is not one of the checkpoint's {rows} rows; use the tokenizer the model was trained with"
        )
    cfg = _model_config(backbone, where, tokenizer.mask_id)
    stored = weights.get(DIT_ROTARY)
    expected = Rotary(cfg.head_dim, cfg.rope_theta).inv_freq
    if stored is not None and (stored.shape != expected.shape or not torch.allclose(stored.float(), expected)):
        raise UserError(
            f"{where}: its rotary frequencies are not theta {cfg.rope_theta:g}'s at head dim {cfg.head_dim}"
        )
    try:
        state = dit_to_torch(weights, cfg)
    except (KeyError, ValueError) as exc:
        raise UserError(f"{where}: weights do not match its config: {exc}") from None
    vocab = max(rows, tokenizer.vocab_size)
    if vocab > rows:
        state = add_vocabulary_rows(state, cfg, vocab)
    return cfg.replace(vocab_size=vocab), state


def _dig(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]..., or None where a level is missing or not a dict."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


class ComposerParts:
    """What a composer checkpoint of the reference's denoiser holds for an import."""

    def __init__(self, path: Path):
        ckpt, self.notes = load_pickle(
            path,
            "where the file is trusted, save its state['model'] tensors with safetensors.torch.save_file and read that",
        )
        model = _dig(ckpt, "state", "model")
        if not isinstance(model, dict):
            raise UserError(f"{path} is not a composer checkpoint: it has no state.model")
        self.weights: dict[str, torch.Tensor] = {}
        for name, t in model.items():
            key = str(name).replace("_orig_mod.", "").removeprefix("module.").removeprefix("model.")
            if key.startswith("backbone.") and isinstance(t, torch.Tensor):
                self.weights[key.removeprefix("backbone.")] = t
        if not self.weights:
            raise UserError(f"{path}: its state.model holds no backbone.* tensors (the denoiser's DiT)")
        hf = _dig(ckpt, "state", "integrations", "huggingface")
        backbone = _dig(hf, "model", "config", "content", "backbone_config")
        self.backbone: dict | None = backbone if isinstance(backbone, dict) else None
        files = _dig(hf, "tokenizer")
        self.tokenizer_files: dict | None = files if isinstance(files, dict) and files else None

    def tokenizer(self, path: Path) -> SetDiffTokenizer:
        """The tokenizer from the files composer recorded (written to a scratch directory)."""
        with tempfile.TemporaryDirectory() as scratch:
            for stem, entry in self.tokenizer_files.items():
                ext, content = _dig(entry, "file_extension"), _dig(entry, "content")
                if Path(str(stem)).name != stem or ext not in _TOKENIZER_FILES or content is None:
                    raise UserError(f"{path}: its recorded tokenizer file {stem!r} ({ext}) is not a tokenizer file")
                text = json.dumps(content) if ext == ".json" else "\n".join(map(str, content))
                (Path(scratch) / f"{stem}{ext}").write_text(text, encoding="utf-8")
            return load_tokenizer(scratch)


def read_composer_checkpoint(
    path: Path, beside_config: dict | None, beside_tokenizer: Callable[[], SetDiffTokenizer]
) -> tuple[ModelConfig, dict[str, torch.Tensor], SetDiffTokenizer, list[str]]:
    """(config, torch weights, tokenizer, notes: what the safe unpickling dropped) of a composer
    .pt; `beside_config` (a config.json next to it, or None) and `beside_tokenizer()` stand in for
    what the checkpoint does not record."""
    parts = ComposerParts(path)
    backbone = parts.backbone or beside_config
    if backbone is None or not is_dit_config(backbone):
        raise UserError(
            f"{path}: no DiT config, neither recorded by composer (integrations.huggingface) nor in a "
            "config.json beside it (the released model's)"
        )
    tokenizer = parts.tokenizer(path) if parts.tokenizer_files else beside_tokenizer()
    cfg, state = dit_state_dict(parts.weights, backbone, tokenizer, path)
    return cfg, state, tokenizer, parts.notes
