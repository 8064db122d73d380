"""The masked-diffusion baselines' training math (core/masked_diffusion.py) and the grouped
attention their models run (core/attention.py `grouped_mask`, `grouped_attention`), against
the reference's rules written out independently here (docs/method.md, "The baselines")."""

import pytest
import torch

from setdiff_megatron.core.attention import grouped_attention, grouped_mask, set_causal_mask
from setdiff_megatron.core.masked_diffusion import (
    SAMPLING_EPS,
    MaskedDiffusionBatch,
    ensure_masked_blocks,
    mask_tokens,
    masked_decoding_policy,
    masked_two_stream_batch,
    sample_masked_batch,
    sample_noise_levels,
)

MASK = 99


def reference_block_mask(length: int, block: int) -> torch.Tensor:
    """BD3-LM's mask over x0 (+) xt as the reference's `_block_mask` states it: block-causal over
    x0, a noisy block sees the clean blocks before it, and each half its own block."""
    n = 2 * length
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    blk_i = torch.where(i >= length, (i - length) // block, i // block)
    blk_j = torch.where(j >= length, (j - length) // block, j // block)
    clean_i, clean_j = i < length, j < length
    block_causal = clean_i & clean_j & (blk_i >= blk_j)
    offset_block_causal = ~clean_i & clean_j & (blk_i > blk_j)
    block_diagonal = (clean_i == clean_j) & (blk_i == blk_j)
    return block_causal | offset_block_causal | block_diagonal


def test_groups_of_one_rank_are_set_causal_attention():
    assert torch.equal(grouped_mask(torch.arange(7)[None])[0], set_causal_mask(7))


@pytest.mark.parametrize("length, block", [(6, 2), (8, 4), (12, 3), (5, 5)])
def test_block_groups_are_the_block_diffusion_mask(length, block):
    groups = (torch.arange(length) // block)[None]
    assert torch.equal(grouped_mask(groups)[0], reference_block_mask(length, block))


def test_one_group_over_one_stream_is_bidirectional():
    assert grouped_mask(torch.zeros(1, 5, dtype=torch.long), streams=1).all()


def dense(q, k, v, allowed, valid_rows):
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return out * valid_rows


@pytest.mark.parametrize("streams, query_rows", [(2, False), (2, True), (1, False)])
def test_grouped_attention_is_the_dense_masked_softmax_with_padding(streams, query_rows):
    gen = torch.Generator().manual_seed(0)
    b, h, length, d = 3, 4, 8, 16
    groups = (torch.arange(length) // 4).expand(b, length).clone()
    valid_len = torch.tensor([8, 5, 3])
    k, v = torch.randn(2, b, 2, streams * length, d, generator=gen).unbind(0)
    rows = length if query_rows else streams * length
    q = torch.randn(b, h, rows, d, generator=gen)
    out = grouped_attention(q, k, v, groups=groups, valid_len=valid_len)
    real = (torch.arange(length)[None] < valid_len[:, None]).repeat(1, streams)
    allowed = grouped_mask(groups, streams)[:, -rows:] & real[:, None, :]
    allowed = allowed | ~real[:, -rows:, None]  # padding rows: anything (then zeroed)
    expected = dense(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), allowed[:, None], real[:, None, -rows:, None]
    )
    torch.testing.assert_close(out, expected)
    assert (out[1, :, -length:][:, 5:] == 0).all()  # padding rows are zero


def test_noise_levels_one_per_row_or_per_block():
    gen = torch.Generator().manual_seed(1)
    per_row = sample_noise_levels(4, 10, block_size=None, generator=gen)
    per_block = sample_noise_levels(4, 10, block_size=4, generator=gen)
    assert (per_row == per_row[:, :1]).all()
    assert [len(set(r[i : i + 4].tolist())) for r in per_block for i in (0, 4, 8)] == [1] * 12
    for t in (per_row, per_block):
        assert bool(((t >= SAMPLING_EPS) & (t < 1)).all())


def test_antithetic_levels_stratify_the_global_batch():
    """Row r of G draws from [r/G, (r+1)/G), mapped to [eps, 1) as the reference maps u."""
    rows = [sample_noise_levels(2, 3, block_size=None, antithetic=True, rank=r, world_rows=8)[:, 0] for r in range(4)]
    u = (torch.cat(rows) - SAMPLING_EPS) / (1 - SAMPLING_EPS)
    assert torch.equal((u * 8).floor().long(), torch.arange(8))


def test_masking_keeps_prompt_and_padding_and_follows_the_level():
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randint(0, 50, (2, 400), generator=gen)
    keep = torch.zeros_like(x0, dtype=torch.bool)
    keep[:, :30] = True
    xt = mask_tokens(x0, torch.tensor([[0.9], [0.2]]).expand(2, 400), keep, MASK, gen)
    assert (xt[:, :30] == x0[:, :30]).all()
    rates = (xt[:, 30:] == MASK).float().mean(1)
    assert abs(rates[0] - 0.9) < 0.06 and abs(rates[1] - 0.2) < 0.06
    assert torch.equal(xt[xt != MASK], x0[xt != MASK])


def reference_ensure_masked_blocks(x0, xt, keep, block, generator):
    """bd3lm.py's `_ensure_no_unmasked_blocks`, as the reference writes it (one pad block when
    the block divides L, randint then rand, a stable argsort)."""
    b, length = xt.shape
    pad = block - length % block
    xt_p = torch.nn.functional.pad(xt, (0, pad), value=MASK - 1)
    ctx_p = torch.nn.functional.pad(keep.long(), (0, pad), value=0)
    nb = (length + pad) // block
    no_mask = ((xt_p == MASK).long() + ctx_p).view(b, nb, block).sum(-1) == 0
    n = torch.randint(0, block, (b, nb), generator=generator)
    r = torch.rand(b, length + pad, generator=generator)
    perm = torch.argsort(r.view(b, nb, block), dim=-1, stable=True)
    sel = perm <= n[..., None]
    xt_p = torch.where(sel.view(b, length + pad) & no_mask.repeat_interleave(block, 1), MASK, xt_p)
    return xt_p[:, :length]


@pytest.mark.parametrize("length, block", [(16, 4), (14, 4)])
def test_every_free_block_gets_a_mask_draw_for_draw_as_the_reference(length, block):
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randint(0, 50, (5, length), generator=gen)
    keep = torch.zeros_like(x0, dtype=torch.bool)
    keep[0, :6] = True  # a prompt
    xt = mask_tokens(x0, torch.full(x0.shape, 0.05), keep, MASK, gen)  # few masks: most blocks empty
    ours = ensure_masked_blocks(x0, xt, keep, block, MASK, torch.Generator().manual_seed(9))
    theirs = reference_ensure_masked_blocks(x0, xt, keep, block, torch.Generator().manual_seed(9))
    assert torch.equal(ours, theirs)
    for row, kept in zip(ours, keep):  # a last, partial block shares its draws with the padding
        for start in range(0, length - length % block, block):
            chunk, k = row[start : start + block], kept[start : start + block]
            assert bool((chunk == MASK).any()) or bool(k.any())


def test_the_batches_the_models_take():
    gen = torch.Generator().manual_seed(4)
    x0 = torch.randint(0, 50, (2, 8), generator=gen)
    prompt = torch.zeros_like(x0, dtype=torch.bool)
    prompt[:, :2] = True
    pad = torch.zeros_like(prompt)
    pad[1, 6:] = True
    batch = sample_masked_batch(x0, mask_token_id=MASK, block_size=4, prompt_mask=prompt, pad_mask=pad, generator=gen)
    assert torch.equal(batch.loss_mask, (batch.xt == MASK) & ~prompt & ~pad) and batch.valid_len.tolist() == [8, 6]
    bd3 = masked_two_stream_batch(batch, 4)
    assert torch.equal(bd3.clean_tokens, x0) and torch.equal(bd3.query_tokens, batch.xt)
    assert bd3.groups.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]] * 2
    mdlm = masked_two_stream_batch(batch, None)
    assert mdlm.clean_tokens is None and mdlm.groups.unique().tolist() == [0]


@pytest.mark.parametrize("block", [4, None])
def test_a_packed_record_trains_as_if_alone_in_a_padded_row(block):
    """Two records packed in a row: each gets its own noise levels and blocks (for BD3-LM, every
    block without a prompt token masked somewhere), its own positions, and the model's logits at
    its positions equal those of the record alone in a padded row with the same noisy tokens."""
    from setdiff_megatron.models.torch_model import SetDiffusionTransformer
    from tests.conftest import debug_config, randomized

    torch.manual_seed(0)
    model = SetDiffusionTransformer(debug_config(attention_impl="sdpa"))
    model.load_state_dict(randomized(model.state_dict(), 2))
    lengths, prompts, width = (6, 8), (2, 3), 16
    gen, mask_id = torch.Generator().manual_seed(5), model.config.mask_token_id
    x0 = torch.randint(0, mask_id, (1, width), generator=gen)
    docs, pos = torch.zeros(1, width, dtype=torch.long), torch.zeros(1, width, dtype=torch.long)
    prompt, pad = torch.zeros(1, width, dtype=torch.bool), torch.zeros(1, width, dtype=torch.bool)
    start = 0
    for doc, (n, p) in enumerate(zip(lengths, prompts)):
        docs[0, start : start + n], pos[0, start : start + n], prompt[0, start : start + p] = doc, torch.arange(n), True
        start += n
    pad[0, start:] = True
    batch = sample_masked_batch(
        x0,
        mask_token_id=mask_id,
        block_size=block,
        prompt_mask=prompt,
        pad_mask=pad,
        records=(docs, pos),
        generator=gen,
    )
    packed = masked_two_stream_batch(batch, block)
    t = batch.t[0]
    start = 0
    for n in lengths:
        span = slice(start, start + n)
        units = pos[0, span] // (block or width)
        for u in units.unique():  # one level per record (MDLM) or per block of it (BD3-LM)
            assert t[span][units == u].unique().numel() == 1
            if block is not None and not prompt[0, span][units == u].any():  # a free block holds a mask
                assert (batch.xt[0, span][units == u] == mask_id).any()
        alone_x0 = torch.full((1, width), mask_id)
        alone_x0[0, :n] = x0[0, span]
        alone_xt = alone_x0.clone()
        alone_xt[0, :n] = batch.xt[0, span]
        alone_pad = (torch.arange(width) >= n)[None]
        alone = masked_two_stream_batch(
            MaskedDiffusionBatch(
                x0=alone_x0,
                xt=alone_xt,
                t=batch.t,
                targets=alone_x0,
                loss_mask=torch.zeros_like(alone_pad),
                position_ids=torch.arange(width)[None],
                valid_len=torch.tensor([n]),
            ),
            block,
        )
        with torch.no_grad():
            whole = model(packed.clean_tokens, packed.query_tokens, packed.position_ids, packed.valid_len,
                          packed.document_ids, groups=packed.groups)  # fmt: skip
            single = model(alone.clean_tokens, alone.query_tokens, alone.position_ids, alone.valid_len,
                           groups=alone.groups)  # fmt: skip
        torch.testing.assert_close(whole[0, span], single[0, :n])
        start += n


def test_masked_decoding_policies_are_the_papers():
    unaligned = {"threshold": 0.9, "align_inputs_to_blocks": False}
    assert masked_decoding_policy(None).settings() == {"window": 32, "block_size": 32, **unaligned}
    assert masked_decoding_policy(4).settings() == {
        "window": 4,
        "block_size": 4,
        "cache_infill_input": True,
        **unaligned,
    }
