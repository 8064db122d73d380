"""The weight map between the torch model and the megatron model: `torch_to_megatron` writes the
chunk of any TP/PP/EP split (sliced as parallel.py says), `megatron_to_torch` reads a whole
(unsplit) model.

Names are megatron-core GPT's, written as `{}` templates over the layer index. The fused QKV and
fc1, the padded vocabulary, the tied output layer, the experts and the `te` backend's fused norms
are not one to one with the torch names (docs/parallelism.md, "How the weights are split").

Shapes: E hidden, H heads, G key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.parallel import (
    check_ep_split,
    check_tp_split,
    pad_vocab,
    stage_layers,
    tp_shard,
)
from setdiff_megatron.models.weight_maps.torch_layout import (
    ADALN_GLOBAL,
    ADALN_LAYER,
    DOWN,
    EMBED,
    FINAL_NORM,
    OUTPUT,
    OUTPUT_BIAS,
    QKV,
    QKV_BIAS,
    ROUTER,
    TORCH_LAYER,
    StateDict,
    check_shapes,
    mlp_inputs,
    mlp_params,
)

__all__ = ["BACKENDS", "MEGATRON_LAYER", "check_backend", "megatron_to_torch", "qkv_rows", "torch_to_megatron"]

BACKENDS = ("local", "te")
MEGATRON_LAYER = "decoder.layers.{}."

# torch suffix -> (megatron suffix, TP split dim or None when replicated); layer-local names.
_LAYER_PLAIN: dict[str, tuple[str, int | None]] = {
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", 1),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", None),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", None),
    ADALN_LAYER[0]: (ADALN_LAYER[0], None),
    ADALN_LAYER[1]: (ADALN_LAYER[1], None),
}
_LAYER_NORMS: dict[str, dict[str, str]] = {
    "local": {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    },
    "te": {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    },
}
_QKV = "self_attention.linear_qkv.weight"
_QKV_BIAS = "self_attention.linear_qkv.bias"
_ROUTER = "mlp.router.weight"
_GLOBAL = {
    # torch name -> megatron name, outside the layers
    EMBED: "embedding.word_embeddings.weight",
    FINAL_NORM: "decoder.final_layernorm.weight",
    OUTPUT: "output_layer.weight",
    OUTPUT_BIAS: "output_layer.bias",
}
_TIME_EMBEDDING = ADALN_GLOBAL[:4]
"""The conditioning MLP, the same names in both models: every pipeline chunk holds a copy."""
_NORM_MODULATION = {t: "decoder.final_layernorm.modulation." + t.rsplit(".", 1)[1] for t in ADALN_GLOBAL[4:]}


def check_backend(cfg: ModelConfig, backend: str) -> None:
    """`te` fuses each block norm into the following linear layer as Transformer Engine's RMSNorm
    or LayerNorm (which always has a bias), and builds the MLP's linear layers with megatron's one
    bias flag, which also puts a bias on the attention projection: it holds neither the DiT's
    bias-free LayerNorm nor MLP biases alone."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "te" and (cfg.norm != "rmsnorm" or cfg.mlp_bias):
        raise ValueError(
            "the 'te' backend holds norm: rmsnorm without mlp_bias only; use backend 'local' for the "
            "DiT layout (norm: layernorm, mlp_bias)"
        )


def _layer_plain(cfg: ModelConfig, backend: str, moe: bool) -> dict[str, tuple[str, int | None]]:
    check_backend(cfg, backend)
    norms = dict(_LAYER_NORMS[backend])
    if moe:  # the router reads the normalised input: no fusing into fc1, under any backend
        norms["post_attention_layernorm.weight"] = _LAYER_NORMS["local"]["post_attention_layernorm.weight"]
    plain = {t: (m, None) for t, m in norms.items()} | _LAYER_PLAIN
    if moe:
        plain[ROUTER] = (_ROUTER, None)
    if not cfg.qk_norm:
        plain = {t: v for t, v in plain.items() if "_norm." not in t}
    if not cfg.adaln:
        plain = {t: v for t, v in plain.items() if t not in ADALN_LAYER}
    return plain


def _mlps(cfg: ModelConfig, moe: bool, backend: str, ep_rank: int, ep_size: int) -> list[tuple[str, str, str]]:
    """(torch prefix, megatron fc1 weight, megatron fc2 weight) of each MLP of a layer that
    expert-parallel rank `ep_rank` holds: the dense MLP, or its experts and the shared experts."""
    if not moe:
        return [("mlp.", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
    per_rank = cfg.num_experts // ep_size
    grouped = backend == "te"
    mlps = [
        (
            f"mlp.experts.{ep_rank * per_rank + j}.",
            f"mlp.experts.linear_fc1.weight{j}" if grouped else f"mlp.experts.local_experts.{j}.linear_fc1.weight",
            f"mlp.experts.linear_fc2.weight{j}" if grouped else f"mlp.experts.local_experts.{j}.linear_fc2.weight",
        )
        for j in range(per_rank)
    ]
    if cfg.num_shared_experts:
        mlps.append(
            ("mlp.shared_experts.", "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight")
        )
    return mlps


def _qkv_groups(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[G, (H/G + 2) * D, E]: megatron's per-group [q ; k ; v] row blocks."""
    g, d = cfg.num_kv_heads, cfg.head_dim
    return torch.cat([q.view(g, -1, q.shape[1]), k.view(g, d, -1), v.view(g, d, -1)], dim=1)


def qkv_rows(cfg: ModelConfig) -> torch.Tensor:
    """[(H + 2G) * D]: row j of megatron's whole linear_qkv is row qkv_rows[j] of torch's
    [q ; k ; v] (how a LoRA adapter's B, kept in torch rows, serves the fused layer)."""
    rows = torch.arange((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)[:, None]
    q, k, v = rows.split(
        [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    )
    return _qkv_groups(cfg, q, k, v).flatten()


def torch_to_megatron(
    state_dict: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    vp_size: int | None = None,
    vp_stage: int | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    backend: str = "local",
) -> StateDict:
    """The state dict of one megatron model chunk (one TP rank, one (virtual) pipeline stage, the
    experts of one expert-parallel rank)."""
    check_tp_split(cfg, tp_size)
    check_ep_split(cfg, ep_size)
    check_shapes(state_dict, cfg)
    layers = stage_layers(cfg.num_layers, pp_size, pp_rank, vp_size, vp_stage)
    first = layers.start == 0
    last = layers.stop == cfg.num_layers
    out: StateDict = {}
    for local, i in enumerate(layers):
        src, dst, moe = TORCH_LAYER.format(i), MEGATRON_LAYER.format(local), cfg.moe_layers[i]
        for t_name, (m_name, dim) in _layer_plain(cfg, backend, moe).items():
            out[dst + m_name] = tp_shard(state_dict[src + t_name], dim, tp_rank, tp_size).clone()
        qkv = _qkv_groups(cfg, *(state_dict[src + n] for n in QKV))
        out[dst + _QKV] = qkv.chunk(tp_size, dim=0)[tp_rank].flatten(0, 1).clone()
        if cfg.qkv_bias:
            bias = _qkv_groups(cfg, *(state_dict[src + n][:, None] for n in QKV_BIAS))  # [G, rows, 1]
            out[dst + _QKV_BIAS] = bias.chunk(tp_size, dim=0)[tp_rank].flatten().clone()
        for prefix, fc1, fc2 in _mlps(cfg, moe, backend, ep_rank, ep_size):
            for suffix in mlp_params(cfg, moe):
                out[dst + fc1.replace(".weight", suffix)] = torch.cat(
                    [tp_shard(state_dict[src + prefix + n + suffix], 0, tp_rank, tp_size) for n in mlp_inputs(cfg, moe)]
                )
                down = state_dict[src + prefix + DOWN + suffix]  # its bias is added after the TP reduction
                out[dst + fc2.replace(".weight", suffix)] = tp_shard(
                    down, 1 if down.dim() == 2 else None, tp_rank, tp_size
                ).clone()
    embed = tp_shard(pad_vocab(state_dict[EMBED], cfg, tp_size), 0, tp_rank, tp_size)
    if first:
        out[_GLOBAL[EMBED]] = embed.clone()
    if last:
        out[_GLOBAL[FINAL_NORM]] = state_dict[FINAL_NORM].clone()
        if not cfg.tie_embeddings:
            out[_GLOBAL[OUTPUT]] = tp_shard(pad_vocab(state_dict[OUTPUT], cfg, tp_size), 0, tp_rank, tp_size).clone()
        if cfg.output_bias:
            out[_GLOBAL[OUTPUT_BIAS]] = tp_shard(
                pad_vocab(state_dict[OUTPUT_BIAS], cfg, tp_size), 0, tp_rank, tp_size
            ).clone()
        if cfg.tie_embeddings and not first:
            out[_GLOBAL[OUTPUT]] = embed.clone()
        if cfg.adaln:
            out |= {m: state_dict[t].clone() for t, m in _NORM_MODULATION.items()}
    if cfg.adaln:
        out |= {name: state_dict[name].clone() for name in _TIME_EMBEDDING}
    return out


def megatron_to_torch(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, *, backend: str = "local") -> StateDict:
    """The torch model's state dict from a whole megatron model's (TP = PP = EP = 1, the form
    sources/megatron_checkpoints.py reads). Every megatron weight must be consumed (`_extra_state` entries
    excepted) and every shape must match."""
    unused = {n for n in state_dict if not n.endswith("_extra_state")}

    def take(name: str) -> torch.Tensor:
        if name not in state_dict:
            raise KeyError(f"the megatron state dict has no {name!r}")
        unused.discard(name)
        return state_dict[name]

    out: StateDict = {}
    q_rows = cfg.num_heads // cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        src, dst, moe = MEGATRON_LAYER.format(i), TORCH_LAYER.format(i), cfg.moe_layers[i]
        for t_name, (m_name, _) in _layer_plain(cfg, backend, moe).items():
            out[dst + t_name] = take(src + m_name).clone()
        groups = take(src + _QKV).view(cfg.num_kv_heads, -1, cfg.hidden_size)
        for name, t in zip(QKV, groups.split([q_rows, cfg.head_dim, cfg.head_dim], dim=1)):
            out[dst + name] = t.flatten(0, 1).clone()
        if cfg.qkv_bias:
            bias = take(src + _QKV_BIAS).view(cfg.num_kv_heads, -1)
            for name, t in zip(QKV_BIAS, bias.split([q_rows, cfg.head_dim, cfg.head_dim], dim=1)):
                out[dst + name] = t.flatten().clone()
        for prefix, fc1, fc2 in _mlps(cfg, moe, backend, 0, 1):
            names = mlp_inputs(cfg, moe)
            for suffix in mlp_params(cfg, moe):
                for name, t in zip(names, take(src + fc1.replace(".weight", suffix)).chunk(len(names))):
                    out[dst + prefix + name + suffix] = t.clone()
                out[dst + prefix + DOWN + suffix] = take(src + fc2.replace(".weight", suffix)).clone()
    out[EMBED] = take(_GLOBAL[EMBED])[: cfg.vocab_size].clone()
    out[FINAL_NORM] = take(_GLOBAL[FINAL_NORM]).clone()
    if not cfg.tie_embeddings:
        out[OUTPUT] = take(_GLOBAL[OUTPUT])[: cfg.vocab_size].clone()
    if cfg.output_bias:
        out[OUTPUT_BIAS] = take(_GLOBAL[OUTPUT_BIAS])[: cfg.vocab_size].clone()
    if cfg.adaln:
        out |= {t: take(m).clone() for t, m in _NORM_MODULATION.items()}
        out |= {name: take(name).clone() for name in _TIME_EMBEDDING}
    if unused:
        raise KeyError(f"megatron weights not mapped: {sorted(unused)}")
    check_shapes(out, cfg)
    return out
