"""Llama, Qwen2, Qwen3 and Qwen3-MoE causal LMs (local Hugging Face directories, safetensors) as
weights of the set diffusion model family.

Under the left-to-right order the clean stream of our model computes exactly what the AR model
computes (same layers, causal attention over the positions so far), so the weights carry over one
to one; what the family cannot represent is refused with the reason (`ar_model_config`). Token ids
beyond the embedding, MASK among them where the tokenizer adds it, get new rows (`ar_state_dict`).
docs/huggingface.md, "Hugging Face", lists what maps and what is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.hf import hf_to_torch
from setdiff_megatron.models.weight_maps.torch_layout import add_vocabulary_rows
from setdiff_megatron.sources.hf_config import rope_theta_of

__all__ = ["SUPPORTED", "ar_model_config", "ar_state_dict", "unsupported_architecture"]

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_WHY_NOT = {
    "qwen2_moe": "its shared expert is scaled by a learnt sigmoid gate (shared_expert_gate), which set "
    "diffusion models' shared experts do not have"
}
"""Architectures near a supported one, and what keeps them out."""
_EMBED = "embed_tokens.weight"
_FUSED_GATE_UP, _FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def supported_text() -> str:
    return ", ".join(SUPPORTED.values()) + " (and set diffusion exports, model_type setdiff)"


def unsupported_architecture(config: Mapping[str, Any], path: Path) -> UserError:
    """The refusal of a config.json's architecture, saying what keeps it out where that is known."""
    model_type = config.get("model_type")
    arch = (config.get("architectures") or [model_type])[0]
    why = f" ({_WHY_NOT[model_type]})" if model_type in _WHY_NOT else ""
    return UserError(f"{path}: architecture {arch!r} is not supported{why}; supported: {supported_text()}")


def _refuse(path: Path, what: str) -> UserError:
    return UserError(f"{path / 'config.json'}: {what}; set diffusion models cannot represent it")


def ar_model_config(config: Mapping[str, Any], path: Path, *, vocab_size: int, mask_token_id: int) -> ModelConfig:
    """Our ModelConfig for a Llama/Qwen2/Qwen3 config.json, or a UserError saying what does not fit."""
    model_type = config.get("model_type")
    arch = (config.get("architectures") or [SUPPORTED.get(model_type, model_type)])[0]
    if model_type not in SUPPORTED or arch != SUPPORTED[model_type]:
        raise unsupported_architecture(config, path)
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(path, f"hidden_act {config['hidden_act']!r} (SwiGLU with SiLU only)")
    scaling = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise _refuse(path, f"rope scaling {rope_type!r} (plain rotary embeddings only)")
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(path, "partial rotary embeddings")
    if config.get("use_sliding_window"):
        raise _refuse(path, "sliding-window attention")
    if config.get("mlp_bias"):
        raise _refuse(path, "mlp_bias (MLP biases)")
    if config.get("attention_bias") and model_type != "qwen2":
        raise _refuse(path, "attention_bias (it adds an output-projection bias; only q/k/v biases are supported)")
    heads = config["num_attention_heads"]
    try:
        return ModelConfig(
            vocab_size=vocab_size,
            mask_token_id=mask_token_id,
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            max_seq_len=config.get("max_position_embeddings", 4096),
            rope_theta=float(rope_theta_of(config) or 10000.0),
            norm_eps=config.get("rms_norm_eps", 1e-6),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            qkv_bias=model_type == "qwen2",
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            **(_qwen3_moe_fields(config, path) if model_type == "qwen3_moe" else {}),
        )
    except (KeyError, ValueError) as exc:
        raise UserError(f"{path / 'config.json'} is incomplete or inconsistent: {exc}") from None


def _qwen3_moe_fields(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields for a Qwen3-MoE config.json (its routing is
    models/moe.py's: norm_topk_prob is a softmax over the k chosen logits, without it
    moe_router_pre_softmax; decoder_sparse_step and mlp_only_layers become a moe_layer_freq list);
    transformers' defaults stand for the keys that change what it computes when they are missing,
    as they do there."""
    step = config.get("decoder_sparse_step", 1)
    if step < 1:
        raise UserError(f"{path / 'config.json'}: decoder_sparse_step must be >= 1; got {step}")
    experts = config["num_experts"] if "num_experts" in config else config["num_local_experts"]
    dense = set(config.get("mlp_only_layers") or ())
    sparse = [int(experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(config["num_hidden_layers"])]
    if not any(sparse):
        return {}  # every layer's MLP is dense: a dense model
    return dict(
        num_experts=experts,
        moe_top_k=config["num_experts_per_tok"],
        moe_intermediate_size=config["moe_intermediate_size"],
        moe_layer_freq=sparse,
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
    )


def _per_expert(hf_weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused experts (gate_up_proj [N, 2I, E], gate rows first, and down_proj [N, E, I]) split into
    the per-expert names save_pretrained writes and hf_to_torch maps; other weights as they are."""
    out = {}
    for name, t in hf_weights.items():
        if name.endswith(_FUSED_GATE_UP):
            base = name.removesuffix("gate_up_proj")
            gates, ups = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gates[e], ups[e]
        elif name.endswith(_FUSED_DOWN):
            base = name.removesuffix("down_proj")
            out |= {f"{base}{e}.down_proj.weight": down for e, down in enumerate(t)}
        else:
            out[name] = t
    return out


def ar_state_dict(
    hf_weights: Mapping[str, torch.Tensor], config: ModelConfig, tokenizer: SetDiffTokenizer, path: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Torch-named weights of an AR checkpoint, with embedding (and output) rows added for token
    ids beyond the source's vocabulary (the MASK among them); returns the final config too."""
    rows = hf_weights[f"model.{_EMBED}"].shape[0] if f"model.{_EMBED}" in hf_weights else config.vocab_size
    source_cfg = config.replace(vocab_size=rows, mask_token_id=min(config.mask_token_id, rows - 1))
    try:
        state = hf_to_torch(_per_expert(hf_weights), source_cfg)
    except (KeyError, ValueError) as exc:
        raise UserError(f"{path}: weights do not match config.json: {exc}") from None
    vocab = max(rows, tokenizer.vocab_size)
    if vocab > rows:
        state = add_vocabulary_rows(state, config, vocab)
    return config.replace(vocab_size=vocab, mask_token_id=tokenizer.mask_id), state
