"""The set diffusion loss: cross-entropy of the query stream against the clean tokens.

Each query at rank j predicts x[perm[j]] from the clean tokens at ranks < j, so the per-token
mean over targets is a one-sample Monte Carlo estimate of the NELBO under the order policy
(docs/method.md, "Objective"). There is no time weighting. The MASK token is never a valid
prediction, so its logit is removed before the softmax, as in the reference.

Shapes: B batch, L ranks, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["LossOutput", "set_diffusion_loss", "token_nll"]


@dataclass(frozen=True)
class LossOutput:
    """`loss` is the mean NLL per target token over the batch; the per-sequence sums serve
    evaluators (perplexity, bits per byte) and data-parallel reductions."""

    loss: torch.Tensor
    nll_sum: torch.Tensor  # [B]
    num_tokens: torch.Tensor  # [B]

    def with_router_loss(self, weighted: torch.Tensor | float) -> LossOutput:
        """`loss` plus a mixture of experts' router losses, given weighted per routed token
        (models/moe.py) and so divided by the target tokens like the NLL; the sums stay NLL."""
        if isinstance(weighted, float | int) and weighted == 0:
            return self
        return LossOutput(self.loss + weighted / self.num_tokens.sum().clamp(min=1), self.nll_sum, self.num_tokens)


def token_nll(logits_BLV: torch.Tensor, targets_BL: torch.Tensor, mask_token_id: int | None) -> torch.Tensor:
    """[B, L] negative log-likelihood of each target (float32 at least)."""
    logits = logits_BLV.float() if logits_BLV.dtype in (torch.float16, torch.bfloat16) else logits_BLV
    if mask_token_id is not None:
        logits = logits.index_fill(-1, torch.tensor([mask_token_id], device=logits.device), float("-inf"))
    return F.cross_entropy(logits.flatten(0, 1), targets_BL.flatten(), reduction="none").view_as(targets_BL)


def set_diffusion_loss(
    logits_BLV: torch.Tensor,
    targets_BL: torch.Tensor,
    loss_mask_BL: torch.Tensor,
    *,
    mask_token_id: int | None = None,
) -> LossOutput:
    if logits_BLV.shape[:2] != targets_BL.shape or loss_mask_BL.shape != targets_BL.shape:
        raise ValueError(
            f"logits [B, L, V], targets [B, L] and loss_mask [B, L] disagree: {tuple(logits_BLV.shape)}, "
            f"{tuple(targets_BL.shape)}, {tuple(loss_mask_BL.shape)}"
        )
    # where, not a product: a non-target whose token is MASK itself has an infinite NLL.
    nll_BL = torch.where(loss_mask_BL, token_nll(logits_BLV, targets_BL, mask_token_id), 0.0)
    nll_sum_B = nll_BL.sum(dim=1)
    num_tokens_B = loss_mask_BL.sum(dim=1)
    loss = nll_sum_B.sum() / num_tokens_B.sum().clamp(min=1)
    return LossOutput(loss=loss, nll_sum=nll_sum_B, num_tokens=num_tokens_B)
