"""`setdiff convert to-hf --layout setdlm`: a checkpoint as the reference's release folder
(sources/setdlm_release.py reads it back), so a model trained here is evaluated by the
reference's own loader and scripts as its released models are.

A DiT-layout model becomes a `backbone_dit.DIT`; a Qwen3-layout one an `AutoModelFromPreTrained`
that re-initialises its model from the base it names (`base_name`) with every architecture number
in its backbone_config, as the CNN/DM releases do. The weights go to pytorch_model.bin under the
denoiser's names (a tied output layer shares the embedding's storage), beside the reference's
derived buffers; the order law (d, m) and L come from the run's recipe. Nothing is written at `out`
unless the folder reads back as the same model, bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from setdiff_megatron.errors import UserError
from setdiff_megatron.hf.weights_io import staged_directory
from setdiff_megatron.models.config import DIT_BODY, ModelConfig
from setdiff_megatron.models.torch_model import Rotary
from setdiff_megatron.models.weight_maps.dit import DIT_ROTARY, torch_to_dit
from setdiff_megatron.models.weight_maps.hf import torch_to_hf
from setdiff_megatron.sources.read import RUN_KINDS, Source, read_source
from setdiff_megatron.sources.setdlm_release import (
    DIT_TARGET,
    MASK_BUFFERS,
    QWEN3_ARCHITECTURE,
    QWEN3_TARGET,
    STAGGERED_TARGET,
    WEIGHTS,
    static_attention_mask,
)

__all__ = ["export_release"]

_AUTO_MAP = {"AutoConfig": "bd3lm.BD3LMConfig", "AutoModelForMaskedLM": "setdlm.SetDLM"}
_QWEN3_BODY = dict(norm="rmsnorm", mlp="swiglu", mlp_bias=False, qk_norm=True, qkv_bias=False, output_bias=False)


def _is_dit(cfg: ModelConfig) -> bool:
    return all(getattr(cfg, k) == v for k, v in DIT_BODY.items() if k != "intermediate_size")


def _backbone(cfg: ModelConfig, length: int, base_name: str | None, where: Path) -> tuple[dict, dict]:
    """(backbone_config, the backbone's weights under its own names)."""
    if cfg.num_experts:
        raise UserError(f"{where} is a mixture of experts; the reference's releases hold dense Qwen3 or DiT backbones")
    if _is_dit(cfg):
        backbone = {
            "_target_": DIT_TARGET,
            "length": cfg.max_seq_len,
            "causal_attention": False,
            "adaln": cfg.adaln,
            "hidden_size": cfg.hidden_size,
            "cond_dim": cfg.adaln_cond_dim,
            "n_heads": cfg.num_heads,
            "num_layers": cfg.num_layers,
            "dropout": 0.0,
            "tie_word_embeddings": False,
            "attn_backend": "sdpa",
            "vocab_size": cfg.vocab_size,
            "block_size": length,
            "pretrained_model_name_or_path": None,
        }
        return backbone, torch_to_dit
    if any(getattr(cfg, k) != v for k, v in _QWEN3_BODY.items()):
        raise UserError(
            f"{where} is neither in the Qwen3 layout (RMSNorm, SwiGLU, q/k norms, no biases) nor the DiT "
            "layout, the two backbones of the reference's releases"
        )
    if not base_name:
        raise UserError(
            "a Qwen3 release names the base model its backbone is built from: pass --base-name, e.g. "
            "--base-name Qwen/Qwen3-1.7B-Base"
        )
    numbers = dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    assert set(numbers) == set(QWEN3_ARCHITECTURE)
    backbone = {
        "_target_": QWEN3_TARGET,
        "automodel_cls": "AutoModel",
        "pretrained_model_name_or_path": base_name,
        "revision": None,
        "trust_remote_code": True,
        "num_layers": cfg.num_layers,
        "keep_top_layers": False,
        "reinit_model": True,
        "attn_implementation": "sdpa",
        "use_causal_mask": False,
        **numbers,
    }
    return backbone, _qwen3_weights


def _qwen3_weights(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """AutoModelFromPreTrained's names (its `model` is a Qwen3ForCausalLM); a tied output layer is
    the embedding's tensor under both names, as the reference's save stores it."""
    hf = {f"model.{k}": t for k, t in torch_to_hf(state, cfg).items()}
    if cfg.tie_embeddings:
        hf["model.lm_head.weight"] = hf["model.model.embed_tokens.weight"]
    return hf


def _architecture(cfg: ModelConfig) -> dict:
    """What a release records of a model: all but the attention kernel and the initialisation."""
    return {k: v for k, v in asdict(cfg).items() if k not in ("attention_impl", "init_std")}


def _config(source: Source, backbone: dict, length: int) -> dict:
    method = source.recipe.method
    tok = source.tokenizer
    ids = dict(
        vocab_size=source.config.vocab_size,
        mask_token_id=tok.mask_id,
        pad_token_id=tok.pad_id,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_vocab_size_multiple=1,
    )
    noise = {
        "_target_": STAGGERED_TARGET,
        "eps": 1e-3,
        "block_size": length,
        "desired_block_size": method.d,
        "max_block_size": method.order_policy().m,
        "length": length,
        **{k: getattr(method, k) for k in ("k", "b") if getattr(method, k) is not None},
    }
    return {
        "architectures": ["SetDLM"],
        "model_type": "bd3lm",
        "auto_map": _AUTO_MAP,
        "length": length,
        "block_size": length,
        "eval_block_size": length,
        "keep_clean_bos": method.keep_clean_bos,
        "attn_backend": "sdpa",
        "train_on_context": False,
        "setdlm_eos_last_in_target_order": False,
        "setdlm_fht_cache_order": False,
        **ids,
        "tokenizer_name": ".",
        "tokenization_config": ids,
        "backbone_config": backbone,
        "noise_config": noise,
        "torch_dtype": "float32",
    }


def _check_source(source: Source, checkpoint: Path) -> int:
    """L, after checking that the run's recipe holds what a release records."""
    if source.recipe is None:
        raise UserError(
            f"{checkpoint} is not a run of this framework or a release: a SetDLM release records the "
            "run's order law and sequence length, which only a recipe holds"
        )
    method = source.recipe.method
    if method.order != "staggered":
        raise UserError(
            f"{checkpoint} was trained with order {method.order!r}; a SetDLM release holds the "
            "staggered order law (method.order: staggered)"
        )
    if not method.keep_clean_bos:
        raise UserError(
            f"{checkpoint} was trained without a clean BOS (method.keep_clean_bos: false), which the "
            "reference's loader always evaluates SetDLM releases with"
        )
    return source.recipe.data.seq_len


def export_release(
    checkpoint: str | Path,
    out: str | Path,
    *,
    base_name: str | None = None,
    base: str | Path | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Write `checkpoint` (a run of ours, or a release: `base` as for read_source) as a SetDLM
    release folder; the report lines."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it")
    source = read_source(checkpoint, base=base)
    if source.kind not in (*RUN_KINDS, "setdlm"):
        raise UserError(f"{source.describe()}: --layout setdlm writes runs of this framework and releases")
    length = _check_source(source, checkpoint)
    backbone, to_names = _backbone(source.config, length, base_name, checkpoint)
    state = {MASK_BUFFERS[0]: static_attention_mask(length)}
    state |= {f"backbone.{k}": t for k, t in to_names(source.state_dict, source.config).items()}
    if backbone["_target_"] == DIT_TARGET:
        state[f"backbone.{DIT_ROTARY}"] = Rotary(source.config.head_dim, source.config.rope_theta).inv_freq
    with staged_directory(out, overwrite=overwrite) as stage:
        torch.save(state, stage / WEIGHTS)
        (stage / "config.json").write_text(json.dumps(_config(source, backbone, length), indent=2, sort_keys=True))
        source.tokenizer.save(stage)
        back = read_source(stage)
        same = (
            _architecture(back.config) == _architecture(source.config)
            and back.tokenizer.sha256 == source.tokenizer.sha256
            and back.state_dict.keys() == source.state_dict.keys()
            and all(torch.equal(back.state_dict[k], source.state_dict[k]) for k in source.state_dict)
        )
        if not same:
            raise UserError(
                f"{out}: the release folder does not read back as {checkpoint} (config or weights differ); "
                "nothing written"
            )
    return [
        f"exported {source.describe()} to {out} as a SetDLM release ({backbone['_target_']}, L = {length}, "
        f"d = {source.recipe.method.d}, m = {source.recipe.method.order_policy().m})",
        "read back: the same config and the same weights, bit for bit",
    ]
