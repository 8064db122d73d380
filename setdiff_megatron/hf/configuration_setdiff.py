"""Hugging Face configuration of a set diffusion transformer (`model_type: setdiff`).

Shipped verbatim beside the weights of an export, so it imports transformers only. It only stores
the fields of config.json: Llama/Qwen's names where those configs have the field, Qwen3-MoE's for a
mixture of experts where it has one, and our own elsewhere (mask_token_id, qk_norm, norm, mlp, ...).
Their defaults and checks live in ModelConfig (setdiff_megatron/models/config.py), which the
modeling file carries.
"""

from transformers import PretrainedConfig


class SetDiffConfig(PretrainedConfig):
    model_type = "setdiff"

    def __init__(self, **kwargs):
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)
