"""The training objective's normalisation, read from a recipe once for both engines.

`train.loss_normalization` names how the token NLLs of a global batch become its loss
(core/loss.py's `loss_weights`): per target token (megatron's), or per row (the reference's mean
over rows of each row's mean). What a row is follows the data: a padded supervised row or a
pretraining window is one row (the reference's rows are both); a packed supervised row holds
several records, and each counts as a row, so a packed run optimises what the same records
padded one per row would (core/orders.py scores a packed record exactly as its padded row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from setdiff_megatron.core.loss import LossWeights, Normalization, loss_weights
from setdiff_megatron.core.policy_gradient import PolicyBatch, PolicyTerms
from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.recipe_data import is_supervised
from setdiff_megatron.recipes.schema import Recipe, RLSection

__all__ = ["Objective"]


@dataclass(frozen=True)
class Objective:
    normalization: Normalization = "per_token"
    per_record: bool = False
    """Rows pack supervised records, and each record is a row of the per-row mean."""
    rl: RLSection | None = None
    """RL's GRPO objective for the rollouts' PolicyBatches (validation batches keep the NLL)."""

    @classmethod
    def of(cls, recipe: Recipe) -> Objective:
        packed = is_supervised(recipe) and recipe.data.supervised.layout == "packed"
        return cls(recipe.train.loss_normalization, packed, recipe.rl)

    def __call__(self, batch: TwoStreamBatch) -> LossWeights | PolicyTerms:
        """The loss weights of one micro-batch, or an RL rollout's clipped objective."""
        if isinstance(batch, PolicyBatch):
            return PolicyTerms.of(batch, clip=self.rl.clip, kl_coef=self.rl.kl_coef)
        rows = None
        if self.normalization == "per_row" and self.per_record:
            ranks = torch.arange(batch.loss_mask.shape[1], device=batch.loss_mask.device)
            rows = torch.where(ranks[None] < batch.valid_len[:, None], batch.document_ids, -1)
        return loss_weights(batch.loss_mask, self.normalization, rows_BL=rows)
