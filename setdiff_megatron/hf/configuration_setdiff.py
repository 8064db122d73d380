"""Hugging Face configuration of a set diffusion transformer (`model_type: setdiff`).

Shipped verbatim beside the weights of an export, so it imports transformers only. The fields
are those of Llama/Qwen configs (hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, intermediate_size, max_position_embeddings, rope_theta,
rms_norm_eps, tie_word_embeddings, vocab_size) plus the set diffusion ones: mask_token_id (the
query-stream token), qk_norm (Qwen3), qkv_bias (Qwen2), attention_impl, the layout of the body
(norm: rmsnorm or layernorm, whose eps is rms_norm_eps; mlp: swiglu or gelu; mlp_bias, Llama's
name; output_bias), and for a mixture of experts Qwen3-MoE's num_experts, num_experts_per_tok,
moe_intermediate_size and router_aux_loss_coef with num_shared_experts, moe_layer_freq (an int
or a 0/1 flag per layer), moe_router_pre_softmax, moe_z_loss_coeff and moe_capacity_factor.
Their defaults and checks live in setdiff_megatron/models/config.py (ModelConfig), which the
modeling file carries; this class only stores them.
"""

from transformers import PretrainedConfig


class SetDiffConfig(PretrainedConfig):
    model_type = "setdiff"

    def __init__(self, **kwargs):
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)
