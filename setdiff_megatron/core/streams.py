"""The two-stream batch of set diffusion training (docs/method.md, "Two streams").

Given tokens and an order perm (perm[b, j] = position revealed at rank j), both streams are laid out
in rank order and carry the ORIGINAL positions as rotary position ids: the clean stream is x[perm],
the query stream is MASK everywhere. Targets and the loss mask are in rank order too. With document
ids (packed windows, or rows of packed supervised records) attention stays within documents.

Shapes: B batch, L sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from setdiff_megatron.core.orders import OrderPolicy, sample_order, sample_record_order

__all__ = ["TwoStreamBatch", "build_two_stream_batch", "concat_batches", "document_ids", "sample_two_stream_batch"]


@dataclass(frozen=True)
class TwoStreamBatch:
    """One training batch in rank order; every field is [B, L] except `valid_len` [B].

    `document_ids`: each rank's document, None when attention may cross documents. `groups`:
    ranks decided together (core/attention.py `grouped_mask`), None for one rank per group (set
    diffusion); the masked-diffusion baselines fill it (core/masked_diffusion.py): BD3-LM's
    blocks over x0 (+) xt, MDLM's one group over a query stream alone (`clean_tokens` None).
    """

    clean_tokens: torch.Tensor | None
    query_tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    valid_len: torch.Tensor
    document_ids: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    group_within: str = "group"
    """How ranks of one group see each other (core/attention.py `grouped_mask`): 'group' (the
    baselines' blocks) or 'rank' (a set sampler's replayed steps)."""

    @property
    def num_targets(self) -> torch.Tensor:
        return self.loss_mask.sum()


def concat_batches(batches: list[TwoStreamBatch]) -> TwoStreamBatch:
    """The rows of `batches`, in order, as one batch (all of one kind: the same optional fields)."""

    def cat(name: str):
        parts = [getattr(b, name) for b in batches]
        return None if parts[0] is None else torch.cat(parts)

    tensors = {f.name: cat(f.name) for f in fields(TwoStreamBatch) if f.name != "group_within"}
    return TwoStreamBatch(**tensors, group_within=batches[0].group_within)


def document_ids(tokens_BL: torch.Tensor, eod_id: int) -> torch.Tensor:
    """[B, L] document index of each position of packed windows: 0 for the first document, one
    more after each EOD token, which belongs to the document it ends."""
    eod_BL = (tokens_BL == eod_id).long()
    return eod_BL.cumsum(dim=1) - eod_BL


def build_two_stream_batch(
    tokens_BL: torch.Tensor,
    perm_BL: torch.Tensor,
    *,
    mask_token_id: int,
    prompt_mask_BL: torch.Tensor | None = None,
    pad_mask_BL: torch.Tensor | None = None,
    document_ids_BL: torch.Tensor | None = None,
    position_ids_BL: torch.Tensor | None = None,
) -> TwoStreamBatch:
    """Gather tokens (and document ids, by position) into rank order and derive the query stream,
    targets and loss mask. The rotary positions are the original positions, or `position_ids_BL`
    (packed records: positions within each record) gathered the same way.

    `perm_BL` must put padding last (as every order policy in core.orders does): `valid_len`
    counts the non-padding ranks and attention treats ranks at or beyond it as padding.
    """
    if tokens_BL.dim() != 2 or perm_BL.shape != tokens_BL.shape:
        raise ValueError(
            f"tokens and perm must both be [batch, length]; got {tuple(tokens_BL.shape)} and {tuple(perm_BL.shape)}"
        )
    for name, m in (
        ("prompt_mask", prompt_mask_BL),
        ("pad_mask", pad_mask_BL),
        ("document_ids", document_ids_BL),
        ("position_ids", position_ids_BL),
    ):
        if m is not None and m.shape != tokens_BL.shape:
            raise ValueError(f"{name} must have shape {tuple(tokens_BL.shape)}; got {tuple(m.shape)}")
    not_target_BL = torch.zeros_like(tokens_BL, dtype=torch.bool)
    if prompt_mask_BL is not None:
        not_target_BL = not_target_BL | prompt_mask_BL
    if pad_mask_BL is not None:
        not_target_BL = not_target_BL | pad_mask_BL
        valid_len_B = tokens_BL.shape[1] - pad_mask_BL.sum(dim=1)
    else:
        valid_len_B = torch.full((tokens_BL.shape[0],), tokens_BL.shape[1], device=tokens_BL.device)

    clean_BL = tokens_BL.gather(1, perm_BL)
    return TwoStreamBatch(
        clean_tokens=clean_BL,
        # MASK at prompt and padding ranks too: only the query itself attends to a query token, and
        # those ranks carry no loss.
        query_tokens=torch.full_like(clean_BL, mask_token_id),
        position_ids=perm_BL if position_ids_BL is None else position_ids_BL.gather(1, perm_BL),
        targets=clean_BL,
        # In rank order, so it is right wherever the order puts prompt and padding tokens (the
        # reference keeps its loss mask in position order, right only while they form a
        # leading/trailing run).
        loss_mask=~not_target_BL.gather(1, perm_BL),
        valid_len=valid_len_B,
        document_ids=None if document_ids_BL is None else document_ids_BL.gather(1, perm_BL),
    )


def sample_two_stream_batch(
    tokens_BL: torch.Tensor,
    policy: OrderPolicy,
    *,
    mask_token_id: int,
    prompt_mask: torch.Tensor | None = None,
    pad_mask: torch.Tensor | None = None,
    keep_clean_bos: bool = False,
    eod_id: int | None = None,
    records: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
) -> TwoStreamBatch:
    """Sample an order from `policy` and build the batch; every engine trains through this.

    A BOS kept clean is pinned first like a prompt token and, like one, is not a target. With
    `eod_id` the batch carries document ids (`document_ids`), for document-masked attention, and
    the order runs over the whole window. `records` = (document ids, position ids) [B, L] marks
    rows that pack supervised records: each record gets its own order (`sample_record_order`),
    its own positions and attention within itself.
    """
    if keep_clean_bos:
        bos_BL = torch.zeros_like(tokens_BL, dtype=torch.bool)
        bos_BL[:, 0] = True
        if pad_mask is not None:
            bos_BL &= ~pad_mask  # an all-padding row has no BOS to keep
        prompt_mask = bos_BL if prompt_mask is None else prompt_mask | bos_BL
    if records is not None:
        if eod_id is not None or prompt_mask is None or pad_mask is None:
            raise ValueError(
                "packed records need prompt_mask and pad_mask, and bring their own document ids (no eod_id)"
            )
        doc_ids, positions = records
        perm_BL = sample_record_order(
            policy, doc_ids, positions, prompt_mask=prompt_mask, pad_mask=pad_mask, generator=generator
        )
        return build_two_stream_batch(
            tokens_BL,
            perm_BL,
            mask_token_id=mask_token_id,
            prompt_mask_BL=prompt_mask,
            pad_mask_BL=pad_mask,
            document_ids_BL=doc_ids,
            position_ids_BL=positions,
        )
    perm_BL = sample_order(
        policy,
        tokens_BL.shape[0],
        tokens_BL.shape[1],
        prompt_mask=prompt_mask,
        pad_mask=pad_mask,
        generator=generator,
        device=tokens_BL.device,
    )
    return build_two_stream_batch(
        tokens_BL,
        perm_BL,
        mask_token_id=mask_token_id,
        prompt_mask_BL=prompt_mask,
        pad_mask_BL=pad_mask,
        document_ids_BL=None if eod_id is None else document_ids(tokens_BL, eod_id),
    )
