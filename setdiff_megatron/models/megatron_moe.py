"""megatron-core's router with the router losses of one rank on every layout.

`SetDiffusionRouter` weights each TP x CP rank's share of the load-balancing loss by the whole
micro-batch's tokens, and in the last layer (`query_rows_only`) routes the clean rows but leaves
them out of the router losses (docs/parallelism.md, "Tested compositions"). megatron_forward
rescales the z-loss coefficient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter

__all__ = ["SetDiffusionRouter", "clean_rows_mask"]


class SetDiffusionRouter(TopKRouter):
    """TopKRouter whose load-balancing share is weighted by the micro-batch's tokens, and which
    honours the padding mask in the last layer (`query_rows_only`) only."""

    def __init__(self, *args, query_rows_only: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.query_rows_only = query_rows_only
        self.micro_batch_tokens: int | torch.Tensor | None = None

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Route `input`, honouring `padding_mask` in the last layer only.

        The model's last layer reads its query rows only (megatron_model.query_rows_layer_spec).
        Under sequence parallelism it runs on every row, since a TP rank holds a slice of both
        streams, so its router takes the clean rows as megatron's padding mask: routed, but left
        out of the router losses and statistics, as on one rank, where they are never computed.
        The model passes that mask to every layer; the other layers' routers route all of their
        rows and ignore it."""
        mask = padding_mask if self.query_rows_only else None
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            self.micro_batch_tokens = self._micro_batch_tokens(input, mask)
        return super().forward(input, mask)

    def _micro_batch_tokens(self, input: torch.Tensor, mask: torch.Tensor | None) -> int | torch.Tensor:
        """The tokens routed, unmasked, by all TP x CP ranks splitting this micro-batch."""
        group = self.tp_cp_group
        if mask is None:  # sequence and context parallelism split the rows evenly
            return input.shape[0] * input.shape[1] * group.size()
        count = (~mask).sum().float()
        if group.size() > 1:
            dist.all_reduce(count, group=group)
        return count

    def attach_and_log_load_balancing_loss(
        self,
        activation: torch.Tensor,
        aux_loss_coeff: float,
        aux_loss: torch.Tensor,
        aux_loss_name: str,
        reduce_group: dist.ProcessGroup,
        reduce_group_has_dp: bool = False,
        valid_token_count: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """megatron-core's, with the share weighted by the micro-batch's tokens.

        Under the per-token loss (`calculate_per_token_loss`) megatron-core attaches each rank's
        share of the load-balancing loss (its own tokens' probabilities against the expert counts
        of the whole micro-batch) weighted by a token count: the rank's own rows, or with a padding
        mask the whole micro-batch's valid ones. The shares over the TP x CP ranks that split a
        micro-batch sum to the micro-batch's loss, so each must be weighted by the micro-batch's
        tokens, as one rank weights the whole loss (`_micro_batch_tokens`)."""
        return super().attach_and_log_load_balancing_loss(
            activation,
            aux_loss_coeff,
            aux_loss,
            aux_loss_name,
            reduce_group,
            reduce_group_has_dp=reduce_group_has_dp,
            valid_token_count=self.micro_batch_tokens,
        )


def clean_rows_mask(rows: int, batch: int, tp_rank: int, tp_size: int, device: torch.device) -> torch.Tensor:
    """[b, rows / tp_size] True on this sequence-parallel rank's rows of the clean stream: of
    the (context-parallel chunk's) [clean ; query] sequence of `rows` rows the rank holds the
    tp_rank-th slice, and the first half is clean."""
    local = rows // tp_size
    ids = torch.arange(tp_rank * local, (tp_rank + 1) * local, device=device)
    return (ids < rows // 2).expand(batch, local)
