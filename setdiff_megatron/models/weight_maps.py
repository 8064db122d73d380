"""Weight maps between the torch model and the megatron model, in one place: `torch_to_megatron`
writes the chunk of any TP/PP/EP split, `megatron_to_torch` reads a whole (unsplit) model.

Names are the upstream ones (torch: Hugging Face Llama/Qwen; megatron: megatron-core GPT), written
as `{}` templates over the layer index. Four things are not one-to-one:

  fused QKV    megatron's linear_qkv holds, per KV group g, [q heads of g ; k_g ; v_g] (rows), and
               each TP rank holds a contiguous run of groups
  fused fc1    megatron's linear_fc1 holds [gate ; up] of its own TP shard of the MLP width (a
               gelu MLP: up alone), its bias likewise; linear_fc2's bias is whole on every rank
  vocab        megatron's embedding and output layer are padded to `padded_vocab_size` rows;
               the padding is zero here (an output bias's too) and is masked out of the logits
  tied output  with tied embeddings the last pipeline stage holds a copy of the embedding as
               output_layer.weight (pp > 1); pp == 1 has no output_layer.weight at all
  experts      an MoE layer's router is mlp.router (torch: Qwen3-MoE's mlp.gate); expert e lives on
               expert-parallel rank e // (N / ep) as local expert e % (N / ep), each one an MLP
               with fused fc1 split over TP like the dense MLP; the shared experts are one such
               MLP (torch: DeepSeek's mlp.shared_experts). The `te` backend's grouped GEMM holds
               local expert j as linear_fc1.weight{j}, and its MoE layers keep their own
               pre_mlp_layernorm (the router reads the normalised input)

The `te` backend fuses the pre-attention and pre-MLP norms into the following linear layer
(layer_norm_weight) and adds `_extra_state` entries, which carry no weights and are skipped.
Optional q/k/v biases (Qwen2) follow the fused QKV rows into megatron's linear_qkv.bias. The
`te` backend holds the RMSNorm body without MLP biases only (`check_backend`).

Hugging Face Llama/Qwen names are the torch names under `model.`, except the untied output layer,
which sits beside the body as `lm_head.weight` and `lm_head.bias` (`torch_to_hf`, `hf_to_torch`).
The reference's DiT checkpoints map one way (`dit_to_torch`): blocks.{i} are layers.{i}, its fused
attn_qkv holds [q ; k ; v] rows (each heads x head dim), its MLP is mlp.0 (up) and mlp.2 (down),
its output layer output_layer.linear beside output_layer.norm_final.
Importing this module needs torch only (checkpoint conversion runs without megatron).

Shapes: V vocabulary, E hidden, H heads, G key/value heads, D head dim, I MLP width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from setdiff_megatron.models.config import ModelConfig

__all__ = [
    "BACKENDS",
    "DIT_ROTARY",
    "add_vocabulary_rows",
    "check_backend",
    "check_ep_split",
    "check_tp_split",
    "dit_to_torch",
    "hf_to_torch",
    "megatron_to_torch",
    "padded_vocab_size",
    "stage_layers",
    "torch_shapes",
    "torch_to_dit",
    "torch_to_hf",
    "torch_to_megatron",
]

BACKENDS = ("local", "te")
VOCAB_PAD_MULTIPLE = 128
"""Rows of megatron's vocabulary are padded to a multiple of lcm(128, tp): GEMM-friendly like
megatron's make_vocab_size_divisible_by, and the same padded size for every power-of-two TP up to
128, so a checkpoint reshards across TP without changing shape."""

StateDict = dict[str, torch.Tensor]

# torch suffix -> (megatron suffix, TP split dim or None when replicated); layer-local names.
_LAYER_PLAIN: dict[str, tuple[str, int | None]] = {
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", 1),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", None),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", None),
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
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_QKV_MEGATRON = "self_attention.linear_qkv.weight"
_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_QKV_BIAS_MEGATRON = "self_attention.linear_qkv.bias"
_ROUTER = ("mlp.gate.weight", "mlp.router.weight")
_MLP_IN = {"swiglu": ("gate_proj", "up_proj"), "gelu": ("up_proj",)}
"""The torch projections megatron's linear_fc1 fuses, in its row order."""
_DOWN = "down_proj"
TORCH_LAYER = "layers.{}."
MEGATRON_LAYER = "decoder.layers.{}."
_EMBED = ("embed_tokens.weight", "embedding.word_embeddings.weight")
_OUTPUT = ("lm_head.weight", "output_layer.weight")
_OUTPUT_BIAS = ("lm_head.bias", "output_layer.bias")
_FINAL_NORM = ("norm.weight", "decoder.final_layernorm.weight")
HF_BODY = "model."
"""Prefix of the body's weights in Hugging Face Llama/Qwen checkpoints (and in our HF export)."""
_HF_IGNORED = ("rotary_emb.inv_freq",)
"""Buffers some older HF checkpoints store; recomputed from rope_theta, never read."""
_HF_OUTSIDE = (_OUTPUT[0], _OUTPUT_BIAS[0])
"""Torch names that Hugging Face keeps beside the body, not under `model.`."""
_DIT_LAYER = {
    # the reference DiT's name under blocks.{i}. -> the torch name under layers.{i}.
    "norm1.weight": "input_layernorm.weight",
    "attn_out.weight": "self_attn.o_proj.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "mlp.0.weight": "mlp.up_proj.weight",
    "mlp.0.bias": "mlp.up_proj.bias",
    "mlp.2.weight": "mlp.down_proj.weight",
    "mlp.2.bias": "mlp.down_proj.bias",
}
_DIT_QKV = "attn_qkv.weight"
_DIT_GLOBAL = {
    "vocab_embed.embedding": _EMBED[0],
    "output_layer.norm_final.weight": _FINAL_NORM[0],
    "output_layer.linear.weight": _OUTPUT[0],
    "output_layer.linear.bias": _OUTPUT_BIAS[0],
}
DIT_ROTARY = _HF_IGNORED[0]
"""The reference DiT's stored rotary frequencies: no weight (its importer checks them against rope_theta)."""


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp_size)
    return -(-vocab_size // multiple) * multiple


def stage_layers(
    num_layers: int, pp_size: int, pp_rank: int, vp_size: int | None = None, vp_stage: int | None = None
) -> range:
    """Global layer indices held by one (virtual) pipeline stage: megatron's even split.

    With virtual stages, chunk `vp_stage` of rank `pp_rank` is model chunk vp_stage * pp + pp_rank.
    """
    num_chunks = pp_size * (vp_size or 1)
    if num_layers % num_chunks:
        raise ValueError(f"num_layers ({num_layers}) must divide evenly over {num_chunks} pipeline chunks")
    per_chunk = num_layers // num_chunks
    start = ((vp_stage or 0) * pp_size + pp_rank) * per_chunk
    return range(start, start + per_chunk)


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
        plain[_ROUTER[0]] = (_ROUTER[1], None)
    if not cfg.qk_norm:
        plain = {t: v for t, v in plain.items() if "_norm." not in t}
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


def check_ep_split(cfg: ModelConfig, ep_size: int) -> None:
    """Megatron spreads each MoE layer's experts evenly over the expert-parallel ranks."""
    if ep_size > 1 and not cfg.num_experts:
        raise ValueError(f"expert parallelism (ep={ep_size}) needs a mixture of experts (model.num_experts > 0)")
    if cfg.num_experts % ep_size:
        raise ValueError(f"num_experts ({cfg.num_experts}) must be divisible by the expert-parallel size ({ep_size})")


def check_tp_split(cfg: ModelConfig, tp_size: int) -> None:
    """Megatron splits heads, KV groups and the MLP width evenly over TP ranks (no KV replication)."""
    widths = [("intermediate_size", cfg.intermediate_size)] if not all(cfg.moe_layers) else []
    if cfg.num_experts:
        widths.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads), *widths):
        if n % tp_size:
            raise ValueError(f"{name} ({n}) must be divisible by the tensor-parallel size ({tp_size})")


def _shard(t: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    return t if dim is None else t.chunk(tp_size, dim=dim)[tp_rank]


def _pad_vocab(t: torch.Tensor, cfg: ModelConfig, tp_size: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(padded_vocab_size(cfg.vocab_size, tp_size) - t.shape[0], *t.shape[1:])])


def _mlp_params(cfg: ModelConfig, moe: bool) -> list[str]:
    """The suffixes of an MLP's parameters: weights, and the dense MLP's biases (experts have none)."""
    return [".weight"] + ([".bias"] if cfg.mlp_bias and not moe else [])


def _mlp_in(cfg: ModelConfig, moe: bool) -> tuple[str, ...]:
    return _MLP_IN["swiglu" if moe else cfg.mlp]


def _qkv_groups(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[G, (H/G + 2) * D, E]: megatron's per-group [q ; k ; v] row blocks."""
    g, d = cfg.num_kv_heads, cfg.head_dim
    return torch.cat([q.view(g, -1, q.shape[1]), k.view(g, d, -1), v.view(g, d, -1)], dim=1)


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
    _check_shapes(state_dict, cfg)
    layers = stage_layers(cfg.num_layers, pp_size, pp_rank, vp_size, vp_stage)
    first = layers.start == 0
    last = layers.stop == cfg.num_layers
    out: StateDict = {}
    for local, i in enumerate(layers):
        src, dst, moe = TORCH_LAYER.format(i), MEGATRON_LAYER.format(local), cfg.moe_layers[i]
        for t_name, (m_name, dim) in _layer_plain(cfg, backend, moe).items():
            out[dst + m_name] = _shard(state_dict[src + t_name], dim, tp_rank, tp_size).clone()
        qkv = _qkv_groups(cfg, *(state_dict[src + n] for n in _QKV))
        out[dst + _QKV_MEGATRON] = qkv.chunk(tp_size, dim=0)[tp_rank].flatten(0, 1).clone()
        if cfg.qkv_bias:
            bias = _qkv_groups(cfg, *(state_dict[src + n][:, None] for n in _QKV_BIAS))  # [G, rows, 1]
            out[dst + _QKV_BIAS_MEGATRON] = bias.chunk(tp_size, dim=0)[tp_rank].flatten().clone()
        for prefix, fc1, fc2 in _mlps(cfg, moe, backend, ep_rank, ep_size):
            for suffix in _mlp_params(cfg, moe):
                out[dst + fc1.replace(".weight", suffix)] = torch.cat(
                    [_shard(state_dict[src + prefix + n + suffix], 0, tp_rank, tp_size) for n in _mlp_in(cfg, moe)]
                )
                down = state_dict[src + prefix + _DOWN + suffix]  # its bias is added after the TP reduction
                out[dst + fc2.replace(".weight", suffix)] = _shard(
                    down, 1 if down.dim() == 2 else None, tp_rank, tp_size
                ).clone()
    embed = _shard(_pad_vocab(state_dict[_EMBED[0]], cfg, tp_size), 0, tp_rank, tp_size)
    if first:
        out[_EMBED[1]] = embed.clone()
    if last:
        out[_FINAL_NORM[1]] = state_dict[_FINAL_NORM[0]].clone()
        if not cfg.tie_embeddings:
            out[_OUTPUT[1]] = _shard(_pad_vocab(state_dict[_OUTPUT[0]], cfg, tp_size), 0, tp_rank, tp_size).clone()
        if cfg.output_bias:
            out[_OUTPUT_BIAS[1]] = _shard(
                _pad_vocab(state_dict[_OUTPUT_BIAS[0]], cfg, tp_size), 0, tp_rank, tp_size
            ).clone()
        if cfg.tie_embeddings and not first:
            out[_OUTPUT[1]] = embed.clone()
    return out


def megatron_to_torch(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, *, backend: str = "local") -> StateDict:
    """The torch model's state dict from a whole megatron model's (TP = PP = EP = 1, the form
    sources/megatron.py reads). Every megatron weight must be consumed (`_extra_state` entries
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
        groups = take(src + _QKV_MEGATRON).view(cfg.num_kv_heads, -1, cfg.hidden_size)
        for name, t in zip(_QKV, groups.split([q_rows, cfg.head_dim, cfg.head_dim], dim=1)):
            out[dst + name] = t.flatten(0, 1).clone()
        if cfg.qkv_bias:
            bias = take(src + _QKV_BIAS_MEGATRON).view(cfg.num_kv_heads, -1)
            for name, t in zip(_QKV_BIAS, bias.split([q_rows, cfg.head_dim, cfg.head_dim], dim=1)):
                out[dst + name] = t.flatten().clone()
        for prefix, fc1, fc2 in _mlps(cfg, moe, backend, 0, 1):
            names = _mlp_in(cfg, moe)
            for suffix in _mlp_params(cfg, moe):
                for name, t in zip(names, take(src + fc1.replace(".weight", suffix)).chunk(len(names))):
                    out[dst + prefix + name + suffix] = t.clone()
                out[dst + prefix + _DOWN + suffix] = take(src + fc2.replace(".weight", suffix)).clone()
    out[_EMBED[0]] = take(_EMBED[1])[: cfg.vocab_size].clone()
    out[_FINAL_NORM[0]] = take(_FINAL_NORM[1]).clone()
    if not cfg.tie_embeddings:
        out[_OUTPUT[0]] = take(_OUTPUT[1])[: cfg.vocab_size].clone()
    if cfg.output_bias:
        out[_OUTPUT_BIAS[0]] = take(_OUTPUT_BIAS[1])[: cfg.vocab_size].clone()
    if unused:
        raise KeyError(f"megatron weights not mapped: {sorted(unused)}")
    _check_shapes(out, cfg)
    return out


def torch_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every torch model weight and its shape, derived from the config alone."""
    e, d = cfg.hidden_size, cfg.head_dim
    layer = {
        "input_layernorm.weight": (e,),
        "post_attention_layernorm.weight": (e,),
        "self_attn.q_proj.weight": (cfg.num_heads * d, e),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * d, e),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * d, e),
        "self_attn.o_proj.weight": (e, cfg.num_heads * d),
    }
    if cfg.qk_norm:
        layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    if cfg.qkv_bias:
        layer |= dict(zip(_QKV_BIAS, ((cfg.num_heads * d,), (cfg.num_kv_heads * d,), (cfg.num_kv_heads * d,))))

    def mlp(prefix: str, width: int, moe: bool = True) -> dict[str, tuple[int, ...]]:
        shapes = {f"{prefix}{n}.weight": (width, e) for n in _mlp_in(cfg, moe)}
        shapes[f"{prefix}{_DOWN}.weight"] = (e, width)
        if ".bias" in _mlp_params(cfg, moe):
            shapes |= {f"{prefix}{n}.bias": (width,) for n in _mlp_in(cfg, moe)} | {f"{prefix}{_DOWN}.bias": (e,)}
        return shapes

    dense = layer | mlp("mlp.", cfg.intermediate_size, moe=False)
    moe = dict(layer)
    if cfg.num_experts:
        moe[_ROUTER[0]] = (cfg.num_experts, e)
        for x in range(cfg.num_experts):
            moe |= mlp(f"mlp.experts.{x}.", cfg.moe_intermediate_size)
        if cfg.num_shared_experts:
            moe |= mlp("mlp.shared_experts.", cfg.num_shared_experts * cfg.moe_intermediate_size)
    shapes = {
        TORCH_LAYER.format(n) + k: s
        for n, is_moe in enumerate(cfg.moe_layers)
        for k, s in (moe if is_moe else dense).items()
    }
    shapes |= {_EMBED[0]: (cfg.vocab_size, e), _FINAL_NORM[0]: (e,)}
    if not cfg.tie_embeddings:
        shapes[_OUTPUT[0]] = (cfg.vocab_size, e)
    if cfg.output_bias:
        shapes[_OUTPUT_BIAS[0]] = (cfg.vocab_size,)
    return shapes


def torch_to_hf(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """Hugging Face Llama/Qwen names for the torch model's weights (tensors are shared, not copied)."""
    _check_shapes(state_dict, cfg)
    return {(name if name in _HF_OUTSIDE else HF_BODY + name): t for name, t in state_dict.items()}


def hf_to_torch(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """The torch model's weights from a Hugging Face Llama/Qwen state dict (or our HF export).

    Every weight must be mapped and have its shape; a tied model's stored `lm_head.weight`, which
    some checkpoints keep, must equal the embedding and is dropped.
    """
    out: StateDict = {}
    unknown = []
    for name, t in state_dict.items():
        if name.endswith(_HF_IGNORED):
            continue
        if name in _HF_OUTSIDE:
            out[name] = t
        elif name.startswith(HF_BODY):
            out[name[len(HF_BODY) :]] = t
        else:
            unknown.append(name)
    if unknown:
        raise KeyError(f"Hugging Face weights not mapped: {sorted(unknown)}")
    if cfg.tie_embeddings and _OUTPUT[0] in out:
        head = out.pop(_OUTPUT[0])
        embed = out.get(_EMBED[0])
        if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
            raise ValueError("lm_head.weight differs from the embedding although tie_word_embeddings is set")
    _check_shapes(out, cfg)
    return out


def add_vocabulary_rows(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, rows: int) -> StateDict:
    """The torch weights with the embedding and the untied output layer (weight and bias) grown
    to `rows` rows, each new one the mean of the existing ones: an "average token" whose scale
    matches the others (for token ids a source's vocabulary lacks)."""
    out = dict(state_dict)
    names = [_EMBED[0]] + ([] if cfg.tie_embeddings else [_OUTPUT[0]]) + ([_OUTPUT_BIAS[0]] if cfg.output_bias else [])
    for name in names:
        t = out[name]
        mean = t.float().mean(0, keepdim=True).to(t.dtype)
        out[name] = torch.cat([t, mean.expand(rows - t.shape[0], *t.shape[1:])])
    return out


def dit_to_torch(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """The torch model's weights from the reference DiT's (its backbone names, prefixes removed;
    `DIT_ROTARY` is left to the importer): every weight must be mapped and have its shape."""
    out: StateDict = {}
    unknown = []
    for name, t in state_dict.items():
        block, _, rest = name.removeprefix("blocks.").partition(".")
        in_block = name.startswith("blocks.") and block.isdigit()
        if name in _DIT_GLOBAL:
            out[_DIT_GLOBAL[name]] = t
        elif in_block and rest in _DIT_LAYER:
            out[TORCH_LAYER.format(block) + _DIT_LAYER[rest]] = t
        elif in_block and rest == _DIT_QKV and t.shape[0] % 3 == 0:
            out |= {TORCH_LAYER.format(block) + n: part for n, part in zip(_QKV, t.chunk(3))}
        elif name != DIT_ROTARY:
            unknown.append(name)
    if unknown:
        raise KeyError(f"reference DiT weights not mapped: {sorted(unknown)}")
    _check_shapes(out, cfg)
    return out


def torch_to_dit(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """The reference DiT's names for the torch model's weights (q, k and v fused into attn_qkv);
    `dit_to_torch` inverts it."""
    _check_shapes(state_dict, cfg)
    to_dit = {torch_name: dit for dit, torch_name in _DIT_GLOBAL.items()}
    out: StateDict = {}
    for name, t in state_dict.items():
        layer, _, rest = name.removeprefix("layers.").partition(".")
        if name in to_dit:
            out[to_dit[name]] = t
        elif rest in _DIT_LAYER.values():
            out[f"blocks.{layer}." + next(k for k, v in _DIT_LAYER.items() if v == rest)] = t
        elif rest == _QKV[0]:
            out[f"blocks.{layer}.{_DIT_QKV}"] = torch.cat([state_dict[TORCH_LAYER.format(layer) + n] for n in _QKV])
    return out


def _check_shapes(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    expected = torch_shapes(cfg)
    if set(sd) != set(expected):
        raise KeyError(
            f"torch weights: missing {sorted(set(expected) - set(sd))}, unexpected {sorted(set(sd) - set(expected))}"
        )
    bad = {k: (tuple(sd[k].shape), s) for k, s in expected.items() if tuple(sd[k].shape) != s}
    if bad:
        raise ValueError(f"torch weights with wrong shapes (got, expected): {bad}")
