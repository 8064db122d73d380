"""Two-stream batches and the loss, in rank order."""

import math
from dataclasses import replace

import pytest
import torch

from setdiff_megatron.core.loss import set_diffusion_loss
from setdiff_megatron.core.orders import Staggered, Uniform
from setdiff_megatron.core.streams import build_two_stream_batch, document_ids, sample_two_stream_batch

MASK = 99


def test_example_of_algorithm_md():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    perm = torch.tensor([[0, 1, 2, 4, 5, 3, 6, 7]])
    batch = build_two_stream_batch(tokens, perm, mask_token_id=MASK)
    assert batch.clean_tokens.tolist() == [[10, 11, 12, 14, 15, 13, 16, 17]]
    assert batch.query_tokens.tolist() == [[MASK] * 8]
    assert batch.position_ids.tolist() == perm.tolist()
    assert batch.targets.tolist() == batch.clean_tokens.tolist()
    assert batch.loss_mask.all()


def test_loss_mask_is_in_rank_order_for_middle_prompts():
    """A prompt token in the middle of a row is pinned first and excluded from the loss."""
    tokens = torch.arange(8)[None].repeat(2, 1)
    prompt = torch.zeros(2, 8, dtype=torch.bool)
    prompt[0, [0, 4]] = True
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 6:] = True
    batch = sample_two_stream_batch(
        tokens,
        Uniform(),
        mask_token_id=MASK,
        prompt_mask=prompt,
        pad_mask=pad,
        generator=torch.Generator().manual_seed(0),
    )
    assert batch.position_ids[0, :2].tolist() == [0, 4]
    assert batch.loss_mask[0].tolist() == [False, False] + [True] * 6
    assert batch.loss_mask[1].tolist() == [True] * 6 + [False] * 2
    assert batch.valid_len.tolist() == [8, 6]
    # Every target is the token at its own original position.
    assert torch.equal(batch.targets, tokens.gather(1, batch.position_ids))


def test_keep_clean_bos_pins_and_excludes_position_zero():
    tokens = torch.arange(16)[None].repeat(4, 1)
    batch = sample_two_stream_batch(
        tokens,
        Staggered(d=2),
        mask_token_id=MASK,
        keep_clean_bos=True,
        generator=torch.Generator().manual_seed(1),
    )
    assert (batch.position_ids[:, 0] == 0).all()
    assert not batch.loss_mask[:, 0].any() and batch.loss_mask[:, 1:].all()


def test_document_ids_count_eod_tokens_and_follow_the_order():
    """An EOD token belongs to the document it ends; the batch carries the ids in rank order."""
    eod = 7
    tokens = torch.tensor([[1, 2, eod, 3, eod, eod, 4, 5], [eod, 1, 2, 3, 4, 5, 6, 8]])
    assert document_ids(tokens, eod).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    batch = sample_two_stream_batch(
        tokens, Uniform(), mask_token_id=MASK, eod_id=eod, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(batch.document_ids, document_ids(tokens, eod).gather(1, batch.position_ids))
    assert sample_two_stream_batch(tokens, Uniform(), mask_token_id=MASK).document_ids is None


def test_loss_is_mean_per_target_token_and_ignores_mask_logit():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 6, (2, 5), generator=gen)
    loss_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out = set_diffusion_loss(logits, targets, loss_mask, mask_token_id=6)
    logp = logits[..., :6].log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    assert math.isclose(out.loss.item(), (nll * loss_mask).sum().item() / 8, rel_tol=1e-12)
    torch.testing.assert_close(out.nll_sum, (nll * loss_mask).sum(1))
    assert out.num_tokens.tolist() == [3, 5]


def test_loss_survives_mask_token_at_non_target():
    logits = torch.zeros(1, 2, 4)
    out = set_diffusion_loss(logits, torch.tensor([[3, 1]]), torch.tensor([[False, True]]), mask_token_id=3)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("bad", ["tokens", "prompt"])
def test_bad_shapes(bad):
    tokens, perm = torch.zeros(2, 4, dtype=torch.long), torch.arange(4)[None].repeat(2, 1)
    with pytest.raises(ValueError, match="prompt_mask" if bad == "prompt" else "tokens and perm"):
        if bad == "tokens":
            build_two_stream_batch(tokens[0], perm, mask_token_id=MASK)
        else:
            build_two_stream_batch(tokens, perm, mask_token_id=MASK, prompt_mask_BL=torch.zeros(2, 3, dtype=torch.bool))


def _records(lengths, prompts, length):
    """Padded rows of records of the given lengths and prompt lengths, and one row packing them."""
    batch = len(lengths)
    prompt, pad = torch.zeros(batch, length, dtype=torch.bool), torch.ones(batch, length, dtype=torch.bool)
    docs, pos = torch.zeros(1, length, dtype=torch.long), torch.zeros(1, length, dtype=torch.long)
    packed_prompt, packed_pad = torch.zeros(1, length, dtype=torch.bool), torch.ones(1, length, dtype=torch.bool)
    offset = 0
    for i, (n, p) in enumerate(zip(lengths, prompts)):
        pad[i, :n], prompt[i, :p] = False, True
        docs[0, offset : offset + n], pos[0, offset : offset + n] = i, torch.arange(n)
        packed_pad[0, offset : offset + n], packed_prompt[0, offset : offset + p] = False, True
        offset += n
    return (prompt, pad), (docs, pos, packed_prompt, packed_pad)


def test_a_packed_record_is_ordered_positioned_and_scored_as_its_padded_row(debug_model):
    """Rows packing supervised records (per-record orders, positions and attention) give every
    record the very loss it has alone in a padded row, drawn from the same generator."""
    lengths, prompts, length = [9, 13, 6], [3, 5, 2], 32
    (prompt, pad), (docs, pos, packed_prompt, packed_pad) = _records(lengths, prompts, length)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 60, (len(lengths), length), generator=gen)
    packed_tokens = torch.cat([tokens[i, :n] for i, n in enumerate(lengths)])
    packed_tokens = torch.cat([packed_tokens, torch.zeros(length - len(packed_tokens), dtype=torch.long)])[None]
    policy = Staggered(d=2)
    rows = sample_two_stream_batch(
        tokens, policy, mask_token_id=63, prompt_mask=prompt, pad_mask=pad, generator=torch.Generator().manual_seed(1)
    )
    packed = sample_two_stream_batch(
        packed_tokens,
        policy,
        mask_token_id=63,
        prompt_mask=packed_prompt,
        pad_mask=packed_pad,
        records=(docs, pos),
        generator=torch.Generator().manual_seed(1),
    )
    assert packed.valid_len.tolist() == [sum(lengths)] and int(packed.loss_mask.sum()) == int(rows.loss_mask.sum())
    real = torch.arange(length) < packed.valid_len[0]
    for i, n in enumerate(lengths):  # each record's ranks, in order, are its padded row's
        mine = real & (packed.document_ids[0] == i)
        assert packed.position_ids[0, mine].tolist() == rows.position_ids[i, :n].tolist()
        assert packed.clean_tokens[0, mine].tolist() == rows.clean_tokens[i, :n].tolist()

    def nll(batch):
        logits = debug_model(
            batch.clean_tokens, batch.query_tokens, batch.position_ids, batch.valid_len, batch.document_ids
        )
        from setdiff_megatron.core.loss import token_nll

        return torch.where(batch.loss_mask, token_nll(logits, batch.targets, 63), 0.0)

    padded_nll, packed_nll = nll(rows), nll(packed)
    per_record = [packed_nll[0, real & (packed.document_ids[0] == i)].sum() for i in range(len(lengths))]
    torch.testing.assert_close(torch.stack(per_record), padded_nll.sum(dim=1), rtol=1e-10, atol=1e-10)
    unmasked = nll(replace(packed, document_ids=None))
    assert (unmasked.sum() - packed_nll.sum()).abs() > 1e-3  # attention across records would change it
