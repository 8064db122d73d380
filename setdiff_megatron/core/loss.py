"""The set diffusion loss: cross-entropy of the query stream against the clean tokens.

The query at rank j predicts x[perm[j]] from the clean tokens at ranks < j; the mean over targets
is a one-sample Monte Carlo estimate of the NELBO under the order policy, with no time weighting
(docs/method.md, "Objective"). `loss_weights` weighs the NLLs per token or per row.

Shapes: B batch, L ranks, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["LossOutput", "LossWeights", "Normalization", "loss_weights", "set_diffusion_loss", "token_nll"]

Normalization = Literal["per_token", "per_row"]


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
    """[B, L] negative log-likelihood of each target (float32 at least). MASK is never a valid
    prediction, so its logit is removed before the softmax, as in the reference."""
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


@dataclass(frozen=True)
class LossWeights:
    """How a batch's token NLLs make its share of a loss that is a ratio of global sums:
    loss = sum over micro-batches and ranks of sum(weight x NLL) / sum of `denominator`. The
    weights depend on masks only, so both are known before the forward pass and the gradient of
    the ratio is exactly the normalised objective however the global batch is split."""

    weight_BL: torch.Tensor
    """[B, L] float: 0 off the loss, 1 per target token, or 1 / the row's count per row."""
    denominator: torch.Tensor
    """Scalar integer: the counted tokens (per token) or the rows (per row)."""

    def apply(self, nll_BL: torch.Tensor) -> torch.Tensor:
        """[B, L] weighted NLL; `where`, not a product, since an unweighted token's NLL may be inf
        (a non-target whose token is MASK itself)."""
        return torch.where(self.weight_BL != 0, nll_BL * self.weight_BL, 0.0)


def loss_weights(
    loss_mask_BL: torch.Tensor,
    normalization: Normalization,
    *,
    counted_BL: torch.Tensor | None = None,
    rows_BL: torch.Tensor | None = None,
) -> LossWeights:
    """The weights of `normalization` for the tokens of `loss_mask_BL` (those whose NLL enters
    the numerator).

    `counted_BL` (default: the loss mask) is what a row's denominator counts: the target tokens
    of set diffusion, the masked tokens of MDLM/BD3-LM. `per_token` (megatron's): each counted
    token weighs 1 and the denominator is their number. `per_row`: each token of a row weighs
    1 / the row's count, and the denominator is the number of rows; a row with nothing counted
    adds 0 to the numerator and still counts as a row (the reference: where(count > 0, row /
    count, 0).mean()).
    `rows_BL` splits the batch's rows into several (packed records): each token's row index
    within its batch row, -1 for tokens of no row (padding); rows present are counted.
    """
    counted = loss_mask_BL if counted_BL is None else counted_BL
    if normalization == "per_token":
        return LossWeights(loss_mask_BL.to(torch.float32), counted.sum())
    if normalization != "per_row":
        raise ValueError(f"loss normalization must be 'per_token' or 'per_row', got {normalization!r}")
    if rows_BL is None:
        count_B = counted.sum(dim=1, keepdim=True)
        weight = torch.where(loss_mask_BL & (count_B > 0), 1.0 / count_B.clamp(min=1), 0.0)
        return LossWeights(weight, torch.tensor(loss_mask_BL.shape[0], device=loss_mask_BL.device))
    present_BL = rows_BL >= 0
    index_BL = rows_BL.clamp(min=0).long()  # a row index is below L
    count_BR = torch.zeros(rows_BL.shape, dtype=torch.long, device=rows_BL.device)
    count_BR.scatter_add_(1, index_BL, (counted & present_BL).long())
    rows_BR = torch.zeros(rows_BL.shape, dtype=torch.long, device=rows_BL.device)
    rows_BR.scatter_add_(1, index_BL, present_BL.long())
    count_BL = count_BR.gather(1, index_BL)
    weight = torch.where(loss_mask_BL & present_BL & (count_BL > 0), 1.0 / count_BL.clamp(min=1), 0.0)
    return LossWeights(weight, (rows_BR > 0).sum())
