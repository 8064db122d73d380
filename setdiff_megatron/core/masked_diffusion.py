"""Training batches of the paper's masked-diffusion baselines, MDLM and BD3-LM, drawn as the reference draws them.

MDLM has one noise level per row and attends bidirectionally over the noisy sequence xt; BD3-LM has
one per block of S positions and puts the clean sequence x0 beside xt under the block-diffusion
mask. The model never sees t, and the training loss has no ELBO weight. What they train and how
they decode: docs/method.md, "The baselines".

Shapes: B rows, L positions, S block size, N blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from setdiff_megatron.core.orders import PAPER_THRESHOLD, PaperDecoding
from setdiff_megatron.core.streams import TwoStreamBatch

__all__ = [
    "SAMPLING_EPS",
    "MDLM_DECODE_BLOCK",
    "masked_decoding_policy",
    "MaskedDiffusionBatch",
    "linear_alpha",
    "sample_noise_levels",
    "mask_tokens",
    "ensure_masked_blocks",
    "sample_masked_batch",
    "block_groups",
    "masked_two_stream_batch",
    "unit_noise_levels",
    "ensure_masked_units",
]

SAMPLING_EPS = 1e-3
"""The smallest noise level (the reference's `sampling_eps`): t lies in [eps, 1)."""
MDLM_DECODE_BLOCK = 32
"""MDLM decodes semi-autoregressively in blocks of this many positions (the paper's setting)."""


def masked_decoding_policy(block_size: int | None) -> PaperDecoding:
    """The default decoding settings of a BD3-LM model (its own blocks) or an MDLM (block_size
    None: blocks of MDLM_DECODE_BLOCK): the most confident masked position of the block plus
    every one at the paper's threshold each step, the first block at the prompt's end as the
    paper's throughput scripts start it (align_inputs_to_blocks false); BD3-LM infills with the
    input's whole blocks cached, as the reference's does (DecodingConfig.cache_infill_input)."""
    size = MDLM_DECODE_BLOCK if block_size is None else block_size
    return PaperDecoding(
        window=size,
        block_size=size,
        threshold=PAPER_THRESHOLD,
        align_inputs_to_blocks=False,
        cache_infill_input=block_size is not None,
    )


def linear_alpha(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha_t, alpha'_t) of the linear schedule, alpha = 1 - t, in float32 as the reference
    computes them (the masking probability is then 1 - alpha, not t itself). The evaluation NELBO
    weighs each masked token by -alpha'/(1 - alpha) = 1/t of its row or block."""
    t = t.float()
    return 1 - t.clamp(0, 1), -torch.ones_like(t)


def sample_noise_levels(
    batch_size: int,
    length: int,
    *,
    block_size: int | None,
    generator: torch.Generator | None = None,
    antithetic: bool = False,
    rank: int = 0,
    world_rows: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[B, L] noise levels: one per row (block_size None), or one per block of `block_size`
    positions. With `antithetic`, row i of this rank's B rows (global row rank * B + i among
    `world_rows`) draws from its own 1/world_rows stratum, u = (u / G + row / G) mod 1."""
    blocks = 1 if block_size is None else -(-length // block_size)
    u = torch.rand(batch_size, blocks, generator=generator, device=device)
    if antithetic:
        total = world_rows if world_rows is not None else batch_size
        offset = torch.arange(rank * batch_size, (rank + 1) * batch_size, device=u.device) / total
        u = (u / total + offset[:, None]) % 1
    t = (1 - SAMPLING_EPS) * u + SAMPLING_EPS
    return t.repeat_interleave(length if block_size is None else block_size, dim=1)[:, :length]


def mask_tokens(
    x0_BL: torch.Tensor,
    t_BL: torch.Tensor,
    keep_BL: torch.Tensor,
    mask_token_id: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """xt: each position not in `keep` (prompt, padding, a clean BOS) masked with probability
    1 - alpha(t), a strict comparison with one uniform per position."""
    alpha, _ = linear_alpha(t_BL)
    draw = torch.rand(x0_BL.shape, generator=generator, device=x0_BL.device)
    return torch.where((draw < 1.0 - alpha) & ~keep_BL, mask_token_id, x0_BL)


def ensure_masked_blocks(
    x0_BL: torch.Tensor,
    xt_BL: torch.Tensor,
    keep_BL: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    generator: torch.Generator | None = None,
    *,
    keep_clean_bos: bool = False,
) -> torch.Tensor:
    """BD3-LM's training rule that every block holds a masked token: a block with no mask and no
    kept position (prompt, padding) gets a uniform random subset of 1..S of its positions masked.

    As the reference computes it, draw for draw: the row is padded by S - L % S positions (a whole
    block when S divides L, which then qualifies), so the draws are always made, subset sizes
    n ~ randint(0, S) first, then one uniform per padded position whose stable argsort within
    the block picks the n + 1 positions. A clean BOS is restored afterwards."""
    b, length = xt_BL.shape
    pad = block_size - length % block_size
    xt = torch.cat([xt_BL, xt_BL.new_full((b, pad), mask_token_id + 1)], dim=1)
    kept = torch.cat([keep_BL, keep_BL.new_zeros((b, pad))], dim=1)
    blocks = (length + pad) // block_size
    unmasked_BN = ((xt == mask_token_id) | kept).view(b, blocks, block_size).sum(-1) == 0
    size_BN = torch.randint(0, block_size, (b, blocks), generator=generator, device=xt.device)
    draw = torch.rand(b, length + pad, generator=generator, device=xt.device)
    order = draw.view(b, blocks, block_size).argsort(dim=-1, stable=True)
    chosen = (order <= size_BN[..., None]).view(b, length + pad) & unmasked_BN.repeat_interleave(block_size, 1)
    xt = torch.where(chosen, mask_token_id, xt)[:, :length]
    if keep_clean_bos:
        xt[:, 0] = x0_BL[:, 0]
    return xt


@dataclass(frozen=True)
class MaskedDiffusionBatch:
    """One training batch of either baseline, in position order; every field is [B, L] but
    `valid_len` [B]."""

    x0: torch.Tensor
    xt: torch.Tensor
    t: torch.Tensor
    targets: torch.Tensor
    """x0 where a masked position is a target (not prompt, padding or BOS), else nothing to score."""
    loss_mask: torch.Tensor
    """The masked target positions: the only ones with a loss."""
    position_ids: torch.Tensor
    valid_len: torch.Tensor
    document_ids: torch.Tensor | None = None
    """Each position's record in rows that pack supervised records (None: one record a row)."""


def sample_masked_batch(
    x0_BL: torch.Tensor,
    *,
    mask_token_id: int,
    block_size: int | None,
    prompt_mask: torch.Tensor | None = None,
    pad_mask: torch.Tensor | None = None,
    keep_clean_bos: bool = False,
    t: torch.Tensor | None = None,
    antithetic: bool = False,
    rank: int = 0,
    world_rows: int | None = None,
    records: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
) -> MaskedDiffusionBatch:
    """Noise levels (unless `t` is given), masks, and for BD3-LM (`block_size`) the masked-block
    rule: the reference's training batch, draw for draw. Padding must come last in each row.

    Every draw goes through `generator`, in the reference's order (the masking uniforms, then
    BD3-LM's subset sizes and their uniforms), so forced levels and draws reproduce its batches.

    `records` = (document ids, position ids) [B, L] marks rows that pack supervised records:
    each record (each of its blocks, for BD3-LM) gets its own noise level and masked-block rule,
    and keeps its own positions, as if alone in a padded row (the reference pads; its draws are
    not reproduced for packed rows)."""
    b, length = x0_BL.shape
    keep = torch.zeros_like(x0_BL, dtype=torch.bool)  # the reference's noise mask: prompt and padding
    for extra in (prompt_mask, pad_mask):
        if extra is not None:
            keep = keep | extra
    units = None
    if records is not None:
        documents, positions = records
        units = documents if block_size is None else documents * (length + 1) + positions // block_size
        if pad_mask is not None:
            units = torch.where(pad_mask, -1, units)
    if t is None and units is not None:
        t = unit_noise_levels(units, generator)
    elif t is None:
        t = sample_noise_levels(
            b,
            length,
            block_size=block_size,
            generator=generator,
            antithetic=antithetic,
            rank=rank,
            world_rows=world_rows,
            device=x0_BL.device,
        )
    xt = mask_tokens(x0_BL, t, keep, mask_token_id, generator)
    if keep_clean_bos:  # drawn like any position, then restored (the draws stay the reference's)
        xt[:, 0] = x0_BL[:, 0]
    if block_size is not None and units is not None:
        xt = ensure_masked_units(xt, keep, units, mask_token_id, generator)
    elif block_size is not None:
        xt = ensure_masked_blocks(x0_BL, xt, keep, block_size, mask_token_id, generator, keep_clean_bos=keep_clean_bos)
    loss_mask = (xt == mask_token_id) & ~keep
    valid_len = torch.full((b,), length, device=x0_BL.device) if pad_mask is None else length - pad_mask.sum(1)
    return MaskedDiffusionBatch(
        x0=x0_BL,
        xt=xt,
        t=t,
        targets=x0_BL,
        loss_mask=loss_mask,
        position_ids=torch.arange(length, device=x0_BL.device).expand(b, length) if records is None else records[1],
        valid_len=valid_len,
        document_ids=None if records is None else records[0],
    )


def _unit_starts(units_BL: torch.Tensor) -> torch.Tensor:
    """[B, L] the first position of each position's unit (units are runs of equal ids)."""
    pos = torch.arange(units_BL.shape[1], device=units_BL.device).expand_as(units_BL)
    new = torch.ones_like(units_BL, dtype=torch.bool)
    new[:, 1:] = units_BL[:, 1:] != units_BL[:, :-1]
    return torch.where(new, pos, 0).cummax(dim=1).values


def unit_noise_levels(units_BL: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, L] one noise level per unit (a packed record, or one block of it): each unit takes the
    uniform drawn at its first position."""
    u = torch.rand(units_BL.shape, generator=generator, device=units_BL.device)
    return (1 - SAMPLING_EPS) * u.gather(1, _unit_starts(units_BL)) + SAMPLING_EPS


def ensure_masked_units(
    xt_BL: torch.Tensor, keep_BL: torch.Tensor, units_BL: torch.Tensor, mask_token_id: int, generator=None
) -> torch.Tensor:
    """The masked-block rule over units of any length (blocks of packed records): a unit with no
    mask and no kept position gets a uniform random subset of 1..its length masked."""
    start = _unit_starts(units_BL)
    size = torch.zeros_like(units_BL).scatter_add_(1, start, torch.ones_like(units_BL)).gather(1, start)
    busy = ((xt_BL == mask_token_id) | keep_BL).long()
    free = torch.zeros_like(units_BL).scatter_add_(1, start, busy).gather(1, start) == 0
    draw = torch.rand(units_BL.shape, generator=generator, device=units_BL.device)
    count = (torch.rand(units_BL.shape, generator=generator, device=units_BL.device) * size).long() + 1
    # a position is picked when fewer than `count` of its unit's positions drew a smaller number
    below = (draw[:, None, :] < draw[:, :, None]) & (start[:, None, :] == start[:, :, None])
    picked = below.sum(-1) < count.gather(1, start)
    return torch.where(free & picked, mask_token_id, xt_BL)


def block_groups(batch_size: int, length: int, block_size: int, device: torch.device | str | None = None):
    """[B, L] block index of each position: BD3-LM's attention groups (core/attention.py
    `grouped_mask`); MDLM is one group (block_size = L)."""
    return (torch.arange(length, device=device) // block_size).expand(batch_size, length)


def masked_two_stream_batch(batch: MaskedDiffusionBatch, block_size: int | None) -> TwoStreamBatch:
    """The batch as the model bodies take it: BD3-LM's x0 (+) xt as the clean and query streams
    with its blocks as groups; MDLM's xt as a query stream alone, one group, bidirectional. In
    packed rows a record is attended to as if alone: MDLM's records are its groups, BD3-LM's
    blocks are counted from each record's start and its records are documents."""
    b, length = batch.x0.shape
    if batch.document_ids is None:
        groups, documents = block_groups(b, length, block_size or length, batch.x0.device), None
    elif block_size is None:
        groups, documents = batch.document_ids, batch.document_ids
    else:
        groups, documents = batch.position_ids // block_size, batch.document_ids
    return TwoStreamBatch(
        clean_tokens=None if block_size is None else batch.x0,
        query_tokens=batch.xt,
        position_ids=batch.position_ids,
        targets=batch.targets,
        loss_mask=batch.loss_mask,
        valid_len=batch.valid_len,
        document_ids=documents,
        groups=groups,
    )
