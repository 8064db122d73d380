"""The set diffusion transformer as a plain, single-device nn.Module.

Used on the CPU, under DeepSpeed and as the Hugging Face export's body; parallelism is applied
from outside. `forward(clean, query, positions)` trains on 2L tokens with set-causal attention;
`step(tokens, positions, cache, n)` samples n clean commits then queries against a KV cache.
Parameter names are Hugging Face Llama/Qwen's, so the weight maps to other bodies stay one-to-one.

Shapes: B batch, L ranks per stream, S = 2L tokens, T step tokens, E hidden, H heads,
G key/value heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from setdiff_megatron.core.attention import grouped_attention, resolve_attention_impl
from setdiff_megatron.core.document_attention import document_attention
from setdiff_megatron.core.loss import LossOutput, set_diffusion_loss
from setdiff_megatron.core.orders import OrderPolicy
from setdiff_megatron.core.streams import sample_two_stream_batch
from setdiff_megatron.kernels import choose_attention_impl
from setdiff_megatron.models.adaln import Modulation, TimestepEmbedding, modulate
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.moe import MLP, MoE, RouterStats
from setdiff_megatron.sampling.kv_cache import CacheSpec, KVCache

__all__ = ["SetDiffusionTransformer", "LayerNorm", "Rotary", "cache_attention_impl", "make_norm"]

# attend(q [B, H, S, D], k [B, G, S, D], v [B, G, S, D]) -> [B, H, S, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Rotary(nn.Module):
    """Rotary embeddings looked up at arbitrary position ids (tokens arrive in a sampled order)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, S, 1, D] over both halves, for `apply_rotary`."""
        angles = position_ids[..., None].float() * self.inv_freq  # [B, S, D/2]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat([cos, cos], -1).unsqueeze(2), torch.cat([-sin, sin], -1).unsqueeze(2)


def apply_rotary(x_BSHD: torch.Tensor, cos_BS1D: torch.Tensor, sin_BS1D: torch.Tensor) -> torch.Tensor:
    """Rotate-half convention (HF Llama): pairs are (i, i + D/2), in float32. Rolling x by D/2 pairs
    each half with the other, so with `Rotary`'s signed sin this is x1 cos - x2 sin, x2 cos + x1 sin
    to the bit, in four ops (a decode step at batch 1 is mostly the dispatch of small ops)."""
    x = _as_float32(x_BSHD)
    out = x * cos_BS1D + x.roll(x.shape[-1] // 2, -1) * sin_BS1D
    return out if out.dtype == x_BSHD.dtype else out.to(x_BSHD.dtype)


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, without a cast where it already is one (a decode step at batch 1 is mostly
    the dispatch of small ops: benchmarks/PERFORMANCE.md, "Against the reference")."""
    return x if x.dtype == torch.float32 else x.float()


class LayerNorm(nn.LayerNorm):
    """LayerNorm with a weight and no bias, computed in float32 whatever the input's dtype (the
    reference's DiT does so under bf16 autocast); the output has the input's dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__(hidden_size, eps=eps, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(_as_float32(x), self.normalized_shape, _as_float32(self.weight), None, self.eps)
        return out if out.dtype == x.dtype else out.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """A block or final norm of the model's `norm` kind over the hidden size."""
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)


def cache_attention_impl(cfg: ModelConfig, weight: torch.Tensor) -> str:
    """The KV cache's step attention: the model's attention_impl, 'auto' resolved for the weights'
    device and dtype ('te'/'flash_attn' run a kernel step, the others masked SDPA)."""
    if cfg.attention_impl != "auto":
        return cfg.attention_impl
    return choose_attention_impl(weight.device.type, weight.dtype, cfg.head_dim).impl


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x_BSE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, first_row: int = 0
    ) -> torch.Tensor:
        """Outputs of tokens first_row.. only; every token still contributes its key and value."""
        b, s, _ = x_BSE.shape
        rows = s - first_row
        q = self.q_proj(x_BSE[:, first_row:] if first_row else x_BSE).view(b, rows, self.num_heads, self.head_dim)
        k = self.k_proj(x_BSE).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BSE).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if first_row == 0:  # one rotation of q and k side by side (the same positions): half the small ops
            q, k = apply_rotary(torch.cat([q, k], 2), cos, sin).split([self.num_heads, self.num_kv_heads], 2)
        else:
            q, k = apply_rotary(q, cos[:, first_row:], sin[:, first_row:]), apply_rotary(k, cos, sin)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(b, rows, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.input_layernorm = make_norm(cfg)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = (
            MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size, gelu=cfg.mlp == "gelu", bias=cfg.mlp_bias)
        )
        self.adaln_modulation = Modulation(cfg.adaln_cond_dim, cfg.hidden_size, 6) if cfg.adaln else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        first_row: int = 0,
        condition: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The hidden states of tokens first_row.. (the last layer skips the rows nobody reads);
        with adaLN, `condition` [C] modulates both norms and gates both branches."""
        residual = x[:, first_row:] if first_row else x
        if self.adaln_modulation is None:
            x = residual + self.self_attn(self.input_layernorm(x), cos, sin, attend, first_row)
            return x + self.mlp(self.post_attention_layernorm(x))
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaln_modulation(condition)
        h = modulate(self.input_layernorm(x), shift_a, scale_a)
        x = residual + gate_a * self.self_attn(h, cos, sin, attend, first_row)
        return x + gate_m * self.mlp(modulate(self.post_attention_layernorm(x), shift_m, scale_m))


class SetDiffusionTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg = cfg.resolved()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, moe) for moe in cfg.moe_layers)
        self.norm = make_norm(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.output_bias)
        self.time_embedding = TimestepEmbedding(cfg.adaln_cond_dim) if cfg.adaln else None
        self.norm_modulation = Modulation(cfg.adaln_cond_dim, cfg.hidden_size, 2) if cfg.adaln else None
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self._attention = resolve_attention_impl(cfg.attention_impl)
        self._scale = 1.0 / math.sqrt(cfg.head_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 * layers)
        so the residual stream's variance does not grow with depth (GPT-2); adaLN's modules as the
        reference initialises them (models/adaln.py)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):  # experts' too
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.num_layers))
            else:
                nn.init.normal_(p, std=std)
        for module in self.modules():
            if isinstance(module, (TimestepEmbedding, Modulation)):
                module.reset_parameters()

    def condition(self) -> torch.Tensor | None:
        """adaLN's conditioning vector [C], None without adaLN."""
        return None if self.time_embedding is None else self.time_embedding()

    def router_stats(self) -> dict[int, RouterStats]:
        """Each MoE layer's routing in the last forward, by layer index (empty for dense models)."""
        return {
            i: layer.mlp.stats
            for i, layer in enumerate(self.layers)
            if isinstance(layer.mlp, MoE) and layer.mlp.stats is not None
        }

    def router_loss(self) -> torch.Tensor | float:
        """The last forward's router losses, weighted per routed token: add to the NLL sum."""
        return sum(s.weighted_loss for s in self.router_stats().values())

    def output_logits(self, hidden: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the last layer's output; with adaLN `condition` is the step's conditioning
        vector where the caller has it (else computed here)."""
        hidden = self.norm(hidden)
        if self.norm_modulation is not None:
            hidden = modulate(hidden, *self.norm_modulation(self.condition() if condition is None else condition))
        return F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)

    def forward(
        self,
        clean_tokens: torch.Tensor | None,
        query_tokens: torch.Tensor,
        position_ids: torch.Tensor,
        valid_len: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        group_within: str = "group",
    ) -> torch.Tensor:
        """Query-stream logits [B, L, V] for two streams of [B, L] tokens in rank order; with
        `document_ids` [B, L] (rank order) attention stays within each document; with `groups`
        [B, L] ranks of a group are decided together (core/attention.py `grouped_mask`, `within`
        `group_within`), and `clean_tokens` may then be None: the query stream alone (MDLM)."""
        return self.output_logits(
            self.hidden_states(
                clean_tokens,
                query_tokens,
                position_ids,
                valid_len,
                document_ids=document_ids,
                groups=groups,
                group_within=group_within,
            )
        )

    def hidden_states(
        self,
        clean_tokens: torch.Tensor | None,
        query_tokens: torch.Tensor,
        position_ids: torch.Tensor,
        valid_len: torch.Tensor | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        group_within: str = "group",
        clean_rows: bool = False,
    ) -> torch.Tensor:
        """The last layer's output (before the final norm): the query stream's [B, L, E].

        Nothing reads the clean stream after the last layer, so that layer computes the query rows
        only. `clean_rows` makes it compute both streams, [B, 2L, E], for callers that do read the
        clean stream: the check that it is an imported AR model's computation (hf/verify.py).
        """
        streams = [query_tokens] if clean_tokens is None else [clean_tokens, query_tokens]
        if query_tokens.dim() != 2 or any(x.shape != query_tokens.shape for x in (*streams, position_ids)):
            raise ValueError(
                "clean_tokens, query_tokens and position_ids must all be [batch, length]; got "
                f"{[tuple(x.shape) for x in (*streams, position_ids)]}"
            )
        if clean_tokens is None and groups is None:
            raise ValueError("a query stream alone needs `groups` (which queries see each other)")
        if groups is not None and groups.shape != query_tokens.shape:
            raise ValueError("groups must be [batch, length] like the streams")
        length = query_tokens.shape[1]
        if length > self.config.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds the model's max_seq_len={self.config.max_seq_len}")
        x = self.embed_tokens(torch.cat(streams, dim=1))
        cos, sin = self.rotary(position_ids.repeat(1, len(streams)))
        if groups is None:
            attend = partial(
                document_attention, self._attention, scale=self._scale, valid_len=valid_len, document_ids=document_ids
            )
        else:
            attend = partial(
                grouped_attention,
                groups=groups,
                valid_len=valid_len,
                scale=self._scale,
                document_ids=document_ids,
                within=group_within,
            )
        condition = self.condition()
        for layer in self.layers[:-1]:
            x = layer(x, cos, sin, attend, condition=condition)
        first_row = 0 if clean_rows or clean_tokens is None else length
        return self.layers[-1](x, cos, sin, attend, first_row=first_row, condition=condition)

    def loss(
        self,
        tokens: torch.Tensor,
        policy: OrderPolicy,
        *,
        prompt_mask: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
        keep_clean_bos: bool = False,
        eod_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> LossOutput:
        """Training objective: sample an order, build the two streams, score the queries; with
        `eod_id` attention stays within the documents the EOD tokens end."""
        batch = sample_two_stream_batch(
            tokens,
            policy,
            mask_token_id=self.config.mask_token_id,
            prompt_mask=prompt_mask,
            pad_mask=pad_mask,
            keep_clean_bos=keep_clean_bos,
            eod_id=eod_id,
            generator=generator,
        )
        logits = self(
            batch.clean_tokens,
            batch.query_tokens,
            batch.position_ids,
            None if pad_mask is None else batch.valid_len,
            batch.document_ids,
        )
        out = set_diffusion_loss(logits, batch.targets, batch.loss_mask, mask_token_id=self.config.mask_token_id)
        return out.with_router_loss(self.router_loss())

    def cache_spec(self) -> CacheSpec:
        p = self.embed_tokens.weight
        return CacheSpec(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, p.dtype, p.device)

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache.of(
            self.cache_spec(), batch_size, capacity, cache_attention_impl(self.config, self.embed_tokens.weight)
        )

    def step(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        num_commit: int,
        commit_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sampling forward: commit `num_commit` clean tokens and score the remaining queries.

        tokens/position_ids [B, T] (or [1, N], packed as the layout planned on `cache` says);
        returns query logits [B, T - num_commit, V]. The commits' K/V are appended to `cache`. With num_commit == T this is a prefill.
        """
        if tokens.dim() != 2 or position_ids.shape != tokens.shape:
            raise ValueError(
                f"tokens and position_ids must both be [batch, tokens]; got {tuple(tokens.shape)}, {tuple(position_ids.shape)}"
            )
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary(position_ids)
        condition = self.condition()
        for i, layer in enumerate(self.layers):
            attend = partial(cache.attend, i, num_commit=num_commit, commit_valid=commit_valid)
            x = layer(x, cos, sin, attend, condition=condition)
        logits = self.output_logits(x[:, num_commit:], condition)
        cache.advance()  # after the logits: a compiled step ends its graph here
        return logits
