"""The mixture-of-experts MLP of the torch body, computing what megatron-core's MoE layer computes.

Routing follows megatron's TopKRouter: top-k of the router logits, softmax over the k chosen
(Hugging Face Qwen3-MoE with norm_topk_prob, the same numbers), or with moe_router_pre_softmax a
softmax over all experts before the top-k (norm_topk_prob false), optional capacity
dropping by routing probability, the Switch load-balancing loss on the full softmax and the ST-MoE
z-loss. Under megatron's per-token loss (`calculate_per_token_loss`) a layer's router losses are
weighted by the number of tokens it routed, then divided with the NLL by the global number of
target tokens: `router_loss` returns them with that weight, for the engine to add to the NLL sum.

Shapes: T tokens routed, E hidden, N experts, K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from setdiff_megatron.models.config import ModelConfig

__all__ = ["MLP", "MoE", "RouterStats", "expert_capacity", "router_losses"]


class MLP(nn.Module):
    """The dense layers' MLP, every expert and the shared experts: SwiGLU (gate, up, down), or
    with `gelu` up and down around a tanh-approximated GELU (the DiT's); `bias` on every projection."""

    def __init__(self, hidden_size: int, width: int, *, gelu: bool = False, bias: bool = False):
        super().__init__()
        self.gate_proj = None if gelu else nn.Linear(hidden_size, width, bias=bias)
        self.up_proj = nn.Linear(hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class RouterStats:
    """One MoE layer's routing in one forward: what the engines log and add to the loss."""

    tokens_per_expert: torch.Tensor
    """[N] tokens each expert computed (after capacity dropping)."""
    load_balancing_loss: torch.Tensor
    """The Switch loss without its coefficient (1.0 when perfectly balanced)."""
    z_loss: torch.Tensor
    """mean(logsumexp(logits)^2), without its coefficient."""
    weighted_loss: torch.Tensor
    """(aux coeff x load balancing + z coeff x z) x tokens routed: the term added to the NLL sum."""


def expert_capacity(num_tokens: int, cfg: ModelConfig) -> int | None:
    """Tokens an expert may take from `num_tokens` routed ones; None when nothing is dropped."""
    if cfg.moe_capacity_factor is None:
        return None
    capacity = math.ceil(num_tokens * cfg.moe_top_k / cfg.num_experts * cfg.moe_capacity_factor)
    return None if capacity > num_tokens else capacity


def router_losses(logits_TN: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(Switch load-balancing loss, z-loss) of router logits, without their coefficients: megatron's
    switch_load_balancing_loss_func on the full softmax and its z_loss_func."""
    tokens = logits_TN.shape[0]
    scores = torch.softmax(logits_TN, dim=-1, dtype=torch.float32)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(cfg.moe_top_k, dim=-1).indices, 1.0)
    balance = (scores.sum(0) * chosen.sum(0)).sum() * cfg.num_experts / (cfg.moe_top_k * tokens * tokens)
    z = torch.logsumexp(logits_TN.float(), dim=-1).square().mean()
    return balance, z


class MoE(nn.Module):
    """Router, routed experts and shared experts (Qwen3-MoE names; DeepSeek's for the shared)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size) if cfg.num_shared_experts else None
        )
        self.stats: RouterStats | None = None

    def route(self, logits_TN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities [T, N], zero off the routed pairs; routed pairs [T, N] bool)."""
        if self.cfg.moe_router_pre_softmax:
            scores = torch.softmax(logits_TN, dim=-1, dtype=torch.float32).type_as(logits_TN)
            top_probs, top_idx = scores.topk(self.cfg.moe_top_k, dim=-1)
        else:
            top_logits, top_idx = logits_TN.topk(self.cfg.moe_top_k, dim=-1)
            top_probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits_TN)
        probs = torch.zeros_like(logits_TN).scatter(1, top_idx, top_probs)
        routed = torch.zeros_like(logits_TN, dtype=torch.bool).scatter(1, top_idx, True)
        capacity = expert_capacity(logits_TN.shape[0], self.cfg)
        if capacity is not None:
            kept = probs.topk(capacity, dim=0, sorted=False).indices
            routed &= torch.zeros_like(routed).scatter(0, kept, True)
            probs = probs * routed
        return probs, routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        probs, routed = self.route(logits)
        balance, z = router_losses(logits, self.cfg)
        out = torch.zeros_like(flat)
        # Every expert runs, on no rows if none reached it: its gradient is then zeros, not None,
        # so data-parallel reductions see the same parameters on every rank (DeepSpeed's buckets).
        for e, expert in enumerate(self.experts):
            rows = routed[:, e].nonzero().flatten()
            out.index_add_(0, rows, expert(flat[rows]) * probs[rows, e, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        weighted = (self.cfg.moe_aux_loss_coeff * balance + self.cfg.moe_z_loss_coeff * z) * flat.shape[0]
        self.stats = RouterStats(routed.sum(0).detach(), balance.detach(), z.detach(), weighted)
        return out.view(shape)
