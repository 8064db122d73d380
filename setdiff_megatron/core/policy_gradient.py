"""GRPO for set diffusion: group-normalised advantages and the clipped ratio objective.

The objective, per token of each completion, has a KL penalty to a frozen reference model
(docs/rl.md, "GRPO"). Its log-probabilities are exact, from the replay of each decode
(sampling/trajectory.py); `one_step_batch` is diffu-GRPO's estimate instead, for comparison.

Shapes: B completions, L ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from setdiff_megatron.core.streams import TwoStreamBatch

__all__ = ["group_advantages", "PolicyBatch", "PolicyTerms", "one_step_batch"]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean over the group's standard deviation
    (+ eps); a group whose rewards are equal teaches nothing (zeros). rewards [B], groups of
    `group_size` consecutive completions of one prompt."""
    grouped = rewards.view(-1, group_size).double()
    centred = grouped - grouped.mean(1, keepdim=True)
    return (centred / (grouped.std(1, keepdim=True, unbiased=False) + eps)).view(-1).to(rewards.dtype)


@dataclass(frozen=True)
class PolicyBatch(TwoStreamBatch):
    """A replayed batch of completions with what the objective needs of each token ([B, L];
    zeros off the loss): its completion's advantage, and its log-probability under the policy
    that sampled it and under the reference model."""

    advantage: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    temperature: float = 1.0
    """The sampling temperature, at which the model body scores the tokens (logits / T)."""


@dataclass(frozen=True)
class PolicyTerms:
    """The clipped GRPO objective of one micro-batch as a function of its tokens' NLL.

    Each completion weighs 1 / its token count and the completions are averaged (GRPO's
    per-sequence mean). It has the `apply(nll)` / `denominator` shape of core/loss.py's
    LossWeights, so the engines run it as they run the NLL."""

    weight_BL: torch.Tensor
    """1 / the completion's token count on its tokens, 0 elsewhere."""
    denominator: torch.Tensor
    """The completions (the global batch's sum is their number)."""
    advantage_BL: torch.Tensor
    old_logp_BL: torch.Tensor
    ref_logp_BL: torch.Tensor
    clip: float
    kl_coef: float

    @classmethod
    def of(cls, batch: PolicyBatch, *, clip: float, kl_coef: float) -> PolicyTerms:
        count = batch.loss_mask.sum(1, keepdim=True)
        weight = torch.where(batch.loss_mask & (count > 0), 1.0 / count.clamp(min=1), 0.0)
        return cls(
            weight,
            torch.tensor(batch.loss_mask.shape[0], device=weight.device),
            batch.advantage,
            batch.old_logp,
            batch.ref_logp,
            clip,
            kl_coef,
        )

    def parts(self, nll_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(policy loss, KL to the reference (k3 estimator), clipped) per token [B, L]."""
        logp = -nll_BL
        ratio = torch.exp(logp - self.old_logp_BL)
        a = self.advantage_BL
        policy = -torch.minimum(ratio * a, ratio.clamp(1 - self.clip, 1 + self.clip) * a)
        log_ref_ratio = self.ref_logp_BL - logp
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        clipped = (ratio - 1).abs() > self.clip
        return policy, kl, clipped

    def apply(self, nll_BL: torch.Tensor) -> torch.Tensor:
        """[B, L] weighted per-token loss; `where`, as LossWeights, since an off-loss NLL may be inf."""
        policy, kl, _ = self.parts(torch.where(self.weight_BL != 0, nll_BL, 0.0))
        return torch.where(self.weight_BL != 0, (policy + self.kl_coef * kl) * self.weight_BL, 0.0)


def one_step_batch(batch: TwoStreamBatch) -> TwoStreamBatch:
    """The completions of a replayed batch scored as diffu-GRPO estimates them: every decided
    token at once, from the prompt alone (one step: the prompt's group, then one group of
    everything decided), rather than through the steps that decided them."""
    ranks = torch.arange(batch.loss_mask.shape[1], device=batch.loss_mask.device)
    padding = ranks[None] >= batch.valid_len[:, None]
    return replace(batch, groups=torch.where(padding, 2, batch.loss_mask.long()))
