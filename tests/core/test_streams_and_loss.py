"""Two-stream batches and the loss, in rank order."""

import math

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
        tokens, Uniform(), mask_token_id=MASK, prompt_mask=prompt, pad_mask=pad,
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
        tokens, Staggered(d=2), mask_token_id=MASK, keep_clean_bos=True,
        generator=torch.Generator().manual_seed(1),
    )
    assert (batch.position_ids[:, 0] == 0).all()
    assert not batch.loss_mask[:, 0].any() and batch.loss_mask[:, 1:].all()


def test_document_ids_count_eod_tokens_and_follow_the_order():
    """An EOD token belongs to the document it ends; the batch carries the ids in rank order."""
    eod = 7
    tokens = torch.tensor([[1, 2, eod, 3, eod, eod, 4, 5], [eod, 1, 2, 3, 4, 5, 6, 8]])
    assert document_ids(tokens, eod).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    batch = sample_two_stream_batch(tokens, Uniform(), mask_token_id=MASK, eod_id=eod,
                                    generator=torch.Generator().manual_seed(0))
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
