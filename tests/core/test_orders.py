"""Tests for setdiff_megatron.core.orders (docs/method.md, "Order policies")."""

from __future__ import annotations

import pytest
import torch

from setdiff_megatron.core.orders import (
    Block,
    LeftToRight,
    PaperDecoding,
    Staggered,
    Uniform,
    make_order_policy,
    sample_order,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _chi_square(values: torch.Tensor, num_bins: int) -> float:
    counts = torch.bincount(values, minlength=num_bins).double()
    expected = values.numel() / num_bins
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical value for 7 degrees of freedom at p = 0.001
CHI2_CRIT_DF7 = 24.322


def _assert_is_perm(perm_BL: torch.Tensor) -> None:
    length = perm_BL.shape[1]
    assert perm_BL.dtype == torch.int64
    assert torch.equal(perm_BL.sort(dim=1).values, torch.arange(length).expand_as(perm_BL))


# -- Staggered schedule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length,d,m,k,b",
    [
        (1024, 4, 8, 0.3364, 0.007759),
        (1024, 8, 16, 0.3399, 0.015399),
        (1024, 16, 32, 0.3469, 0.030332),
        (768, 16, 32, 0.3515, 0.040050),
        (128, 4, 8, 0.3581, 0.059259),
        (128, 16, 32, 0.4504, 0.201258),
    ],
)
def test_schedule_matches_table(length, d, m, k, b):
    k_got, b_got, loc_L = Staggered(d, m).schedule(length)
    assert k_got == pytest.approx(k, abs=5e-5)
    assert b_got == pytest.approx(b, abs=5e-7)
    assert k_got / (k_got + 1) * b_got == pytest.approx(d / (2 * length))  # area identity
    assert loc_L.shape == (length,)
    assert loc_L[0] == pytest.approx(1 - b_got) and loc_L[-1] == 0


def test_schedule_worked_example_and_default_m():
    policy = Staggered(2)
    assert policy.m == 4
    k, b, loc_L = policy.schedule(8)
    assert k == pytest.approx(11 / 21, rel=1e-12)
    assert b == pytest.approx(4 / 11, rel=1e-12)
    assert torch.allclose(loc_L, torch.arange(7, -1, -1, dtype=torch.float64) / 11)


def test_schedule_overrides():
    k, b, _ = Staggered(4, 8, k=0.5).schedule(1024)
    assert b == pytest.approx(4 / 2048 * 3)
    k, b, _ = Staggered(4, 8, b=0.01).schedule(1024)
    assert k == pytest.approx((4 / 2048) / (0.01 - 4 / 2048))
    assert Staggered(1).schedule(16)[:2] == (1.0, 1 / 16)


@pytest.mark.parametrize("d,mean_disp", [(4, 1.74), (8, 3.67), (16, 7.47)])
def test_staggered_displacement_statistics(d, mean_disp):
    length, m = 1024, 2 * d
    perm_BL = sample_order(Staggered(d, m), 128, length, generator=_gen(d))
    _assert_is_perm(perm_BL)
    disp_BL = (torch.arange(length) - perm_BL).abs().double()
    assert disp_BL.mean().item() == pytest.approx(mean_disp, rel=0.03)
    assert disp_BL.max().item() <= m - 1


@pytest.mark.parametrize("length", [1, 2, 7, 1024])
def test_d1_and_left_to_right_are_identity(length):
    ident_BL = torch.arange(length).expand(8, length)
    assert torch.equal(sample_order(Staggered(1), 8, length, generator=_gen(0)), ident_BL)
    assert torch.equal(sample_order(LeftToRight(), 8, length, generator=_gen(0)), ident_BL)


@pytest.mark.parametrize("policy", [Staggered(8, 8), Uniform()], ids=["d=m=L", "uniform"])
def test_uniform_first_position(policy):
    length, draws = 8, 4000
    if isinstance(policy, Staggered):
        k, b, loc_L = policy.schedule(length)
        assert (k, b) == (1.0, 1.0) and torch.all(loc_L == 0)
    perm_BL = sample_order(policy, draws, length, generator=_gen(1))
    _assert_is_perm(perm_BL)
    assert _chi_square(perm_BL[:, 0], length) < CHI2_CRIT_DF7
    # and the last rank too: a policy that only shuffles position 0 would pass the first check
    assert _chi_square(perm_BL[:, -1], length) < CHI2_CRIT_DF7


def test_chi_square_detects_bias():
    # guards the statistic itself: a clearly non-uniform sample must fail the same threshold
    biased = sample_order(Staggered(2, 4), 4000, 8, generator=_gen(1))[:, 0]
    assert _chi_square(biased, 8) > CHI2_CRIT_DF7


@pytest.mark.parametrize("size,length", [(4, 16), (3, 10), (1, 5), (16, 16)])
def test_block_order(size, length):
    perm_BL = sample_order(Block(size), 256, length, generator=_gen(2))
    _assert_is_perm(perm_BL)
    block_BL = perm_BL // size
    # blocks in order: block index never decreases along the ranks
    assert torch.all(block_BL[:, 1:] >= block_BL[:, :-1])
    ident_BL = torch.arange(length).expand_as(perm_BL)
    if size > 1:
        assert not torch.equal(perm_BL, ident_BL)  # shuffled inside blocks
    else:
        assert torch.equal(perm_BL, ident_BL)


# -- prompts, padding, BOS ----------------------------------------------------------------------


def _mixed_masks() -> tuple[torch.Tensor, torch.Tensor]:
    length = 12
    prompt_BL = torch.zeros(4, length, dtype=torch.bool)
    pad_BL = torch.zeros(4, length, dtype=torch.bool)
    prompt_BL[0, :3] = True  # prompt 3, no pad
    prompt_BL[1, :5] = True
    pad_BL[1, 9:] = True  # prompt 5, pad 3
    prompt_BL[2, [0, 3, 4, 8]] = True  # non-contiguous prompt
    pad_BL[2, [6, 11]] = True  # non-contiguous pad
    pad_BL[3, :] = True  # fully padded row
    return prompt_BL, pad_BL


@pytest.mark.parametrize("policy", [Staggered(2, 4), Uniform(), Block(3), LeftToRight()])
@pytest.mark.parametrize("keep_clean_bos", [False, True])
def test_mixed_batch_prompt_first_pad_last(policy, keep_clean_bos):
    prompt_BL, pad_BL = _mixed_masks()
    perm_BL = sample_order(
        policy, prompt_mask=prompt_BL, pad_mask=pad_BL, keep_clean_bos=keep_clean_bos, generator=_gen(3)
    )
    _assert_is_perm(perm_BL)
    # scores the policy drew in that call, to check the target order
    scores_BL = policy.reveal_scores(4, 12, generator=_gen(3), device="cpu")
    for row in range(4):
        first = prompt_BL[row].clone()
        if keep_clean_bos and not pad_BL[row, 0]:
            first[0] = True
        first_pos = first.nonzero().flatten().tolist()
        pad_pos = pad_BL[row].nonzero().flatten().tolist()
        order = perm_BL[row].tolist()
        n_first, n_pad = len(first_pos), len(pad_pos)
        assert order[:n_first] == first_pos
        assert order[len(order) - n_pad :] == pad_pos
        targets = order[n_first : len(order) - n_pad]
        assert sorted(targets) == sorted(set(range(12)) - set(first_pos) - set(pad_pos))
        target_scores = scores_BL[row, targets]
        assert torch.all(target_scores[:-1] >= target_scores[1:])


def test_keep_clean_bos_pins_position_zero():
    perm_BL = sample_order(Uniform(), 512, 8, keep_clean_bos=True, generator=_gen(4))
    assert torch.all(perm_BL[:, 0] == 0)
    assert len(set(perm_BL[:, 1].tolist())) == 7  # the rest is still shuffled


def test_masks_infer_shape_and_device():
    prompt_BL, pad_BL = _mixed_masks()
    perm_BL = sample_order(Uniform(), prompt_mask=prompt_BL, generator=_gen(0))
    assert perm_BL.shape == prompt_BL.shape and perm_BL.device == prompt_BL.device


# -- reproducibility ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [Staggered(4), Uniform(), Block(4)])
def test_seeded_reproducibility(policy):
    a_BL = sample_order(policy, 4, 64, generator=_gen(7))
    b_BL = sample_order(policy, 4, 64, generator=_gen(7))
    c_BL = sample_order(policy, 4, 64, generator=_gen(8))
    assert torch.equal(a_BL, b_BL)
    assert not torch.equal(a_BL, c_BL)


def test_make_order_policy():
    assert make_order_policy("staggered", d=4) == Staggered(4, 8)
    assert make_order_policy("left_to_right") == LeftToRight()
    assert make_order_policy("uniform") == Uniform()
    assert make_order_policy("block", size=4) == Block(4)


# -- validation ---------------------------------------------------------------------------------

_BOOL_2x4 = torch.zeros(2, 4, dtype=torch.bool)
_BOTH = torch.zeros(2, 4, dtype=torch.bool)
_BOTH[1, 2] = True

BAD_INPUTS = [
    ("d<1", lambda: Staggered(0), "d"),
    ("d>m", lambda: Staggered(4, 2), "d (4) must be <= m (2)"),
    ("m>L", lambda: Staggered(4, 8).schedule(4), "d = m = length"),
    ("m>L scores", lambda: Staggered(2).reveal_scores(1, 3, generator=None, device="cpu"), "m"),
    ("k=0", lambda: Staggered(4, k=0.0), "k"),
    ("k<0", lambda: Staggered(4, k=-1.0), "k"),
    ("k makes b>1", lambda: Staggered(4, k=1e-6).schedule(16), "k"),
    ("b<=area", lambda: Staggered(4, b=0.001).schedule(1024), "b"),
    ("b>1", lambda: Staggered(4, b=1.5), "b"),
    ("b<=0", lambda: Staggered(4, b=0.0), "b"),
    ("k and b", lambda: Staggered(4, k=0.5, b=0.1), "k and b are exclusive"),
    ("block size", lambda: Block(0), "size"),
    ("length<1", lambda: sample_order(Uniform(), 2, 0), "length"),
    ("length<1 schedule", lambda: Staggered(1).schedule(0), "length"),
    ("unknown name", lambda: make_order_policy("spiral"), "name"),
    ("prompt shape", lambda: sample_order(Uniform(), 2, 5, prompt_mask=_BOOL_2x4), "prompt_mask"),
    ("pad shape", lambda: sample_order(Uniform(), 3, 4, pad_mask=_BOOL_2x4), "pad_mask"),
    ("prompt dtype", lambda: sample_order(Uniform(), prompt_mask=_BOOL_2x4.long()), "prompt_mask"),
    ("prompt and pad", lambda: sample_order(Uniform(), prompt_mask=_BOTH, pad_mask=_BOTH), "prompt_mask"),
    ("no shape", lambda: sample_order(Uniform()), "batch_size"),
]


@pytest.mark.parametrize("call,arg", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise(call, arg):
    with pytest.raises(ValueError) as info:
        call()
    assert arg in str(info.value)


def test_unknown_name_lists_allowed_values():
    with pytest.raises(ValueError, match="left_to_right"):
        make_order_policy("ar")


@pytest.mark.parametrize(
    "policy, settings",
    [
        (Staggered(d=1), {"window": 1}),
        (Staggered(d=4), {"window": 4, "threshold": 0.9}),
        (LeftToRight(), {"window": 1}),
        (Uniform(), {"window": 16, "threshold": 0.9}),
        (Block(size=8), {"window": 8, "block_size": 8, "threshold": 0.9}),
    ],
)
def test_decoding_policy_is_typed_and_sets_only_its_own_settings(policy, settings):
    paper = policy.decoding_policy()
    assert isinstance(paper, PaperDecoding)
    assert paper.settings() == settings
