"""Two-stream batches and the loss, in rank order."""

import math
from dataclasses import replace

import pytest
import torch

from setdiff_megatron.core.loss import loss_weights, set_diffusion_loss, token_nll
from setdiff_megatron.core.orders import Staggered, Uniform
from setdiff_megatron.core.streams import build_two_stream_batch, document_ids, sample_two_stream_batch
from setdiff_megatron.training.objective import Objective

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


def _padded_and_packed(lengths, prompts, length):
    """The same records (random tokens) as padded rows and packed in one row, ordered from the
    same generator."""
    (prompt, pad), (docs, pos, packed_prompt, packed_pad) = _records(lengths, prompts, length)
    tokens = torch.randint(0, 60, (len(lengths), length), generator=torch.Generator().manual_seed(5))
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
    return rows, packed


def test_a_packed_record_is_ordered_positioned_and_scored_as_its_padded_row(debug_model):
    """Rows packing supervised records (per-record orders, positions and attention) give every
    record the very loss it has alone in a padded row, drawn from the same generator."""
    lengths, length = [9, 13, 6], 32
    rows, packed = _padded_and_packed(lengths, [3, 5, 2], length)
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


def _reference_per_row_loss(logits, batch, mask_token_id):
    """The reference's training loss (setdlms src/denoiser/setdlm.py, ref-baselines §3(a)), written
    out here: each row's NLL summed over its targets and divided by their count, rows without
    targets giving 0, then the mean over rows."""
    log_p = logits.index_fill(-1, torch.tensor([mask_token_id]), float("-inf")).log_softmax(-1)
    log_p = log_p.gather(-1, batch.targets[..., None]).squeeze(-1)
    row = -torch.where(batch.loss_mask, log_p, 0.0).sum(-1)
    count = batch.loss_mask.sum(-1)
    return torch.where(count > 0, row / count, torch.zeros_like(row)).mean()


def _unequal_responses(mask_token_id: int):
    """Four supervised rows of length 24: prompts of 3-6 tokens, responses of 2-17 tokens and one
    row whose response is all cut away (prompt and padding only)."""
    prompts, lengths, length = [3, 6, 4, 5], [20, 8, 21, 5], 24
    tokens = torch.randint(0, mask_token_id, (4, length), generator=torch.Generator().manual_seed(3))
    ranks = torch.arange(length)[None]
    prompt = ranks < torch.tensor(prompts)[:, None]
    pad = ranks >= torch.tensor(lengths)[:, None]
    return sample_two_stream_batch(
        tokens,
        Staggered(d=2),
        mask_token_id=mask_token_id,
        prompt_mask=prompt,
        pad_mask=pad,
        generator=torch.Generator().manual_seed(4),
    )


def test_per_row_loss_equals_the_references_on_unequal_responses(debug_model):
    """train.loss_normalization=per_row: the mean over rows of each row's mean NLL, as the reference
    trains (a row without targets counts as a row with loss 0), whether the rows come in one
    micro-batch or several; per_token gives the batch's NLL over its targets, as before."""
    batch = _unequal_responses(63)
    assert batch.loss_mask.sum(1).tolist() == [17, 2, 17, 0]
    logits = debug_model(batch.clean_tokens, batch.query_tokens, batch.position_ids, batch.valid_len)
    nll = token_nll(logits, batch.targets, 63)
    expected = _reference_per_row_loss(logits, batch, 63)

    weights = Objective("per_row")(batch)
    assert int(weights.denominator) == 4
    torch.testing.assert_close(
        weights.apply(nll).sum() / weights.denominator, expected, rtol=1e-6, atol=0
    )  # fp32 weights
    halves = [Objective("per_row")(_rows_of(batch, rows)) for rows in (slice(0, 1), slice(1, 4))]
    split = sum(w.apply(nll[rows]).sum() for w, rows in zip(halves, (slice(0, 1), slice(1, 4))))
    torch.testing.assert_close(split / sum(w.denominator for w in halves), expected, rtol=1e-6, atol=0)  # fp32 weights
    assert (expected - set_diffusion_loss(logits, batch.targets, batch.loss_mask, mask_token_id=63).loss).abs() > 0.01

    per_token = Objective("per_token")(batch)
    out = set_diffusion_loss(logits, batch.targets, batch.loss_mask, mask_token_id=63)
    assert torch.equal(per_token.apply(nll).sum(dim=1), out.nll_sum)  # bitwise: the default is unchanged
    assert int(per_token.denominator) == int(out.num_tokens.sum())


def _rows_of(batch, rows: slice):
    """The batch's rows `rows`, as a micro-batch of its own."""
    return type(batch)(**{k: None if v is None else v[rows] for k, v in vars(batch).items()})


def test_per_row_counts_each_packed_record_as_a_row(debug_model):
    """A row packing supervised records: each record is a row of the per-row mean, so the packed
    batch's loss is the padded batch's, record by record; padding is no row."""
    rows, packed = _padded_and_packed([9, 13, 6], [3, 5, 2], 32)

    def loss(batch, objective):
        logits = debug_model(
            batch.clean_tokens, batch.query_tokens, batch.position_ids, batch.valid_len, batch.document_ids
        )
        weights = objective(batch)
        return weights.apply(token_nll(logits, batch.targets, 63)).sum() / weights.denominator, weights

    padded, padded_weights = loss(rows, Objective("per_row"))
    by_record, record_weights = loss(packed, Objective("per_row", per_record=True))
    assert int(padded_weights.denominator) == int(record_weights.denominator) == 3
    torch.testing.assert_close(by_record, padded, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(
        padded,
        _reference_per_row_loss(
            debug_model(rows.clean_tokens, rows.query_tokens, rows.position_ids, rows.valid_len), rows, 63
        ),
        rtol=1e-6,
        atol=0,
    )
    one_row, _ = loss(packed, Objective("per_row"))
    assert (one_row - by_record).abs() > 1e-3  # the packed row as one row is another objective


def test_loss_weights_count_what_they_are_told():
    """The denominator of a row may count other tokens than those in the numerator (MDLM and
    BD3-LM divide by their masked tokens); a row counting nothing weighs 0."""
    loss_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    counted = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    weights = loss_weights(loss_mask, "per_row", counted_BL=counted)
    assert weights.weight_BL.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.25, 0.25, 0.0, 0.0], [0.0] * 4]
    assert int(weights.denominator) == 3
    assert int(loss_weights(loss_mask, "per_token", counted_BL=counted).denominator) == 6
    with pytest.raises(ValueError, match="per_token"):
        loss_weights(loss_mask, "per_sample")
