"""Document masking: set-causal attention that never crosses a document of a packed window.

With `document_ids` [B, L] (rank order) row i attends key j only where the set-causal rule allows
it AND both are in the same document. Every implementation is exact under it through one
regrouping: within a document the relative rank order is kept, so the masked attention equals
plain set-causal attention of each document's own ranks, taken as a sub-sequence of a padded
batch. So no implementation needs a document mask of its own.
"""

from __future__ import annotations

import torch

from setdiff_megatron.core.attention_shapes import AttentionImpl, stream_length

__all__ = ["document_attention"]


def document_attention(
    fn: AttentionImpl,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    valid_len: torch.Tensor | None,
    document_ids: torch.Tensor | None,
) -> torch.Tensor:
    """`fn` restricted to each document (`fn` itself without document ids).

    Each (row, document)'s ranks, in rank order, fill one sub-sequence of a batch padded to the
    longest document; padding ranks of a row form a group of their own with no real rank, so
    their outputs stay zero. `fn` runs once on that batch and the outputs go back through
    differentiable gathers, so outputs and gradients are `fn`'s own. Costs: host syncs for the
    sub-batch's shape, and the sub-batch holds (documents x longest document) ranks per stream,
    up to documents times the window's when one long document shares it with short ones.
    """
    if document_ids is None:
        return fn(q, k, v, scale, valid_len)
    length = stream_length(k, valid_len)
    if document_ids.shape != (k.shape[0], length):
        raise ValueError(
            f"document_ids must have shape [batch, L]=[{k.shape[0]}, {length}]; got {tuple(document_ids.shape)}"
        )
    dest, sub_valid, width = _document_slots(document_ids, valid_len)
    num_groups = sub_valid.shape[0]
    out = fn(*(_to_documents(x, dest, num_groups, width) for x in (q, k, v)), scale, sub_valid)
    return _from_documents(out, dest, q.shape[0], width)


def _document_slots(
    document_ids: torch.Tensor, valid_len: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(dest [B*L]: each (row, rank)'s index in the [groups * width] sub-sequence slots,
    real ranks per group [groups], width = the largest group).

    A group is a (row, document) pair, padding ranks of a row a group apart; a rank's slot in
    its group is the number of the group's ranks before it, which keeps the rank order.
    """
    b, length = document_ids.shape
    ids = document_ids.long()
    ranks = torch.arange(length, device=ids.device)
    real = torch.ones_like(ids, dtype=torch.bool) if valid_len is None else ranks < valid_len[:, None]
    ids = torch.where(real, ids - ids.min() + 1, 0)  # 0: padding
    rows = torch.arange(b, device=ids.device)[:, None]
    _, group, sizes = torch.unique(
        (rows * (int(ids.max()) + 1) + ids).flatten(), return_inverse=True, return_counts=True
    )
    order = group.argsort(stable=True)  # by group, then by row-major index: by rank within a group
    slot = torch.empty_like(order)
    slot[order] = torch.arange(b * length, device=ids.device) - (sizes.cumsum(0) - sizes)[group[order]]
    width = int(sizes.max())
    sub_valid = torch.zeros_like(sizes).index_add_(0, group, real.flatten().long())
    return group * width + slot, sub_valid, width


def _to_documents(x: torch.Tensor, dest: torch.Tensor, num_groups: int, width: int) -> torch.Tensor:
    """[B, H, S*L, D] (S = 2 streams, or 1: the query rows) -> [groups, H, S*width, D], each
    stream's ranks in their slots, empty slots zero."""
    b, h, rows, d = x.shape
    streams = rows // (dest.shape[0] // b)
    ranks = x.unflatten(2, (streams, -1)).movedim(3, 1).flatten(0, 1)  # [B*L, H, S, D]
    slots = ranks.new_zeros(num_groups * width, h, streams, d).index_copy(0, dest, ranks)
    return slots.unflatten(0, (num_groups, width)).movedim(1, 3).flatten(2, 3)


def _from_documents(y: torch.Tensor, dest: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[groups, H, S*width, D] -> [B, H, S*L, D]: `_to_documents` undone on the occupied slots."""
    _, h, rows, d = y.shape
    slots = y.unflatten(2, (rows // width, width)).movedim(3, 1).flatten(0, 1)  # [groups*width, H, S, D]
    return slots.index_select(0, dest).unflatten(0, (batch, -1)).movedim(1, 3).flatten(2, 3)
