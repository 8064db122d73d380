"""Hugging Face config names <-> ModelConfig, and generation_config.json <-> DecodingConfig.

One table each, used by the exporter (writing config.json and generation_config.json), by the
importer (reading Llama/Qwen configs) and, bundled into the export's modeling file, by the
Hugging Face model itself. A mixture of experts adds the MOE_CONFIG_KEYS, which a dense model's
config.json leaves out (their values would describe experts it does not have), and the reference
DiT's adaLN the ADALN_CONFIG_KEYS. Imports only the
package's config dataclasses and the baselines' decoding policy, so the bundle stays torch +
transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from setdiff_megatron.core.masked_diffusion import masked_decoding_policy
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.sampling.decoding import SETTINGS, DecodingConfig

__all__ = [
    "MOE_CONFIG_KEYS",
    "hf_config_from_model_config",
    "model_config_from_hf_config",
    "rope_theta_of",
    "generation_config_from_decoding",
    "decoding_config_from_generation",
    "with_family_policy",
]

HF_CONFIG_KEYS: dict[str, str] = {
    # Hugging Face config key -> ModelConfig field
    "vocab_size": "vocab_size",
    "mask_token_id": "mask_token_id",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_seq_len",
    "rope_theta": "rope_theta",
    "norm": "norm",
    "rms_norm_eps": "norm_eps",  # the eps of either norm kind
    "mlp": "mlp",
    "mlp_bias": "mlp_bias",
    "qk_norm": "qk_norm",
    "qkv_bias": "qkv_bias",
    "tie_word_embeddings": "tie_embeddings",
    "output_bias": "output_bias",
    "attention_impl": "attention_impl",
    "initializer_range": "init_std",
}

MOE_CONFIG_KEYS: dict[str, str] = {
    # Hugging Face config key -> ModelConfig field, mixtures of experts only; Qwen3-MoE's key where
    # Qwen3-MoE has the field with the same meaning
    "num_experts": "num_experts",
    "num_experts_per_tok": "moe_top_k",
    "moe_intermediate_size": "moe_intermediate_size",
    "num_shared_experts": "num_shared_experts",
    "moe_layer_freq": "moe_layer_freq",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "router_aux_loss_coef": "moe_aux_loss_coeff",
    "moe_z_loss_coeff": "moe_z_loss_coeff",
    "moe_capacity_factor": "moe_capacity_factor",
}

ADALN_CONFIG_KEYS: dict[str, str] = {
    # Hugging Face config key -> ModelConfig field, models with the reference DiT's adaLN only
    "adaln": "adaln",
    "adaln_cond_dim": "adaln_cond_dim",
}

GENERATION_KEYS: dict[str, str] = {
    **{name: name for name in SETTINGS if name != "temperature"},
    "stop_token_sequences": "stop_sequences",
}
"""generation_config.json key -> DecodingConfig field, from the settings' one declaration;
do_sample/temperature and eos_token_id are mapped apart."""


def rope_theta_of(config: Mapping[str, Any]) -> float | None:
    """rope_theta at the top level (transformers 4) or in rope_parameters (transformers 5)."""
    params = config.get("rope_parameters") or {}
    return params.get("rope_theta", config.get("rope_theta"))


def hf_config_from_model_config(cfg: ModelConfig) -> dict[str, Any]:
    values = dataclasses.asdict(cfg)
    keys = HF_CONFIG_KEYS | (MOE_CONFIG_KEYS if cfg.num_experts else {}) | (ADALN_CONFIG_KEYS if cfg.adaln else {})
    return {key: values[name] for key, name in keys.items()}


def model_config_from_hf_config(config: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json (ours, or a Llama/Qwen one already checked by the importer)."""
    keys = HF_CONFIG_KEYS | MOE_CONFIG_KEYS | ADALN_CONFIG_KEYS
    values = {name: config[key] for key, name in keys.items() if config.get(key) is not None}
    theta = rope_theta_of(config)
    if theta is not None:
        values["rope_theta"] = float(theta)
    return ModelConfig(**values).resolved()


def generation_config_from_decoding(cfg: DecodingConfig, *, mask_token_id: int, pad_token_id: int) -> dict[str, Any]:
    """generation_config.json for a DecodingConfig; `decoding_config_from_generation` inverts it."""
    out: dict[str, Any] = {"do_sample": cfg.temperature > 0}
    if cfg.temperature > 0:
        out["temperature"] = cfg.temperature
    values = dataclasses.asdict(cfg)
    out |= {key: values[name] for key, name in GENERATION_KEYS.items()}
    out["stop_token_sequences"] = [list(s) for s in cfg.stop_sequences]
    out |= {"eos_token_id": list(cfg.eos_token_ids), "pad_token_id": pad_token_id, "mask_token_id": mask_token_id}
    return out


def with_family_policy(generation: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """generation-config values with a baseline family's own policy (config.json's family and
    block_size) under the keys they lack: a BD3-LM export written before cache_infill_input
    existed still infills as the reference's BD3-LM does. Keys present, None included, win."""
    family = config.get("family", "set_diffusion")
    if family not in ("mdlm", "bd3lm"):
        return dict(generation)
    policy = masked_decoding_policy(config.get("block_size") if family == "bd3lm" else None).settings()
    return {**{k: v for k, v in policy.items() if k not in generation}, **generation}


def decoding_config_from_generation(config: Mapping[str, Any], **overrides: Any) -> DecodingConfig:
    """DecodingConfig from generation-config values (None: the DecodingConfig default) and
    `generate` keyword arguments, which win. Without do_sample decoding is greedy."""
    allowed = {*GENERATION_KEYS, "do_sample", "temperature", "eos_token_id"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise TypeError(f"generate() got unknown arguments {unknown}; set diffusion decoding takes {sorted(allowed)}")
    merged = {**{k: v for k, v in config.items() if k in allowed}, **overrides}
    values = {name: merged[key] for key, name in GENERATION_KEYS.items() if merged.get(key) is not None}
    if "stop_sequences" in values:
        values["stop_sequences"] = tuple(tuple(int(t) for t in s) for s in values["stop_sequences"])
    eos = merged.get("eos_token_id")
    if eos is not None:
        values["eos_token_ids"] = tuple(int(t) for t in ([eos] if isinstance(eos, int) else eos))
    values["temperature"] = float(merged.get("temperature") or 1.0) if merged.get("do_sample") else 0.0
    return DecodingConfig(**values)
