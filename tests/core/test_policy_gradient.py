"""GRPO's pieces (core/policy_gradient.py): group-normalised advantages, the clipped ratio with
its KL penalty as a function of the tokens' NLL, and the one-step estimate's replay groups."""

import math

import torch

from setdiff_megatron.core.policy_gradient import PolicyBatch, PolicyTerms, group_advantages, one_step_batch


def test_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-3)
    assert torch.equal(adv[4:], torch.zeros(4))  # a group of equal rewards teaches nothing


def _batch(loss_mask, advantage, old, ref) -> PolicyBatch:
    b, length = loss_mask.shape
    zeros = torch.zeros(b, length, dtype=torch.long)
    return PolicyBatch(
        clean_tokens=zeros,
        query_tokens=zeros,
        position_ids=zeros,
        targets=zeros,
        loss_mask=loss_mask,
        valid_len=torch.full((b,), length),
        advantage=advantage,
        old_logp=old,
        ref_logp=ref,
    )


def test_the_clipped_objective_and_its_gradient():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = torch.tensor([[2.0, 2.0, 0.0], [-1.0, -1.0, -1.0]])
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -3.0]], requires_grad=True)
    terms = PolicyTerms.of(_batch(mask, adv, logp.detach(), logp.detach()), clip=0.2, kl_coef=0.1)
    loss = terms.apply(-logp).sum() / terms.denominator
    # at the sampling policy the ratio is 1 and the KL 0: the loss is minus the mean advantage
    assert math.isclose(loss.item(), -(2.0 * 2 / 2 + -1.0 * 3 / 3) / 2, abs_tol=1e-6)
    loss.backward()
    # d loss / d logp = -A / (tokens of the completion) / completions
    expected = torch.tensor([[-2.0 / 2 / 2, -2.0 / 2 / 2, 0.0], [1.0 / 3 / 2] * 3])
    assert torch.allclose(logp.grad, expected)


def test_a_ratio_past_the_clip_on_the_advantages_side_stops_its_gradient():
    mask = torch.tensor([[True, True]])
    old = torch.tensor([[-1.0, -1.0]])
    logp = torch.tensor([[-1.0 + math.log(1.5), -1.0 + math.log(1.1)]], requires_grad=True)  # ratios 1.5, 1.1
    terms = PolicyTerms.of(_batch(mask, torch.ones(1, 2), old, logp.detach()), clip=0.2, kl_coef=0.0)
    terms.apply(-logp).sum().backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0
    _, _, clipped = terms.parts(-logp.detach())
    assert clipped.tolist() == [[True, False]]


def test_the_kl_penalty_is_the_k3_estimator():
    mask = torch.tensor([[True]])
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    terms = PolicyTerms.of(_batch(mask, torch.zeros(1, 1), logp, ref), clip=0.2, kl_coef=1.0)
    _, kl, _ = terms.parts(-logp)
    assert math.isclose(kl.item(), math.exp(-0.5) + 0.5 - 1, rel_tol=1e-6)


def test_the_one_step_estimate_scores_every_completion_token_from_the_prompt():
    mask = torch.tensor([[False, False, True, True, True, False]])
    batch = _batch(mask, torch.zeros(1, 6), torch.zeros(1, 6), torch.zeros(1, 6))
    batch = PolicyBatch(**{**batch.__dict__, "valid_len": torch.tensor([5]), "groups": torch.zeros(1, 6).long()})
    assert one_step_batch(batch).groups.tolist() == [[0, 0, 1, 1, 1, 2]]
