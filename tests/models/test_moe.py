"""The torch body's mixture of experts (models/moe.py): routing, capacity dropping, router losses
and their weight in the loss. Parity with megatron-core's layer is in tests/models (test_megatron_*.py)."""

import math

import pytest
import torch

from setdiff_megatron.core.orders import Staggered
from setdiff_megatron.models.moe import MoE, expert_capacity
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from tests.conftest import debug_config

MOE = dict(num_experts=4, moe_top_k=2, moe_intermediate_size=32)


def _layer(**changes) -> tuple[MoE, torch.Tensor]:
    torch.manual_seed(0)
    layer = MoE(debug_config(**(MOE | changes))).double()
    return layer, torch.randn(3, 10, 64, dtype=torch.float64)


def test_output_is_the_probability_weighted_sum_of_the_chosen_experts():
    layer, x = _layer(num_shared_experts=1)
    out = layer(x).reshape(-1, 64)
    flat = x.reshape(-1, 64)
    logits = layer.gate(flat)
    top, idx = logits.topk(2, dim=-1)
    weights = top.softmax(-1)
    for t in range(flat.shape[0]):
        expected = layer.shared_experts(flat[t])
        for w, e in zip(weights[t], idx[t]):
            expected = expected + w * layer.experts[int(e)](flat[t])
        torch.testing.assert_close(out[t], expected)


def test_dropless_routes_every_token_to_k_experts_and_balance_is_one_when_uniform():
    layer, x = _layer()
    layer(x)
    assert int(layer.stats.tokens_per_expert.sum()) == 30 * 2
    with torch.no_grad():
        layer.gate.weight.zero_()  # every logit equal: softmax uniform, Switch loss exactly 1
    layer(x)
    assert layer.stats.load_balancing_loss.item() == pytest.approx(1.0)
    assert layer.stats.z_loss.item() == pytest.approx(math.log(4) ** 2)


def test_capacity_keeps_each_experts_most_probable_tokens():
    layer, x = _layer(moe_capacity_factor=0.5)
    capacity = expert_capacity(30, layer.cfg)
    assert capacity == math.ceil(30 * 2 / 4 * 0.5) == 8
    probs, routed = layer.route(layer.gate(x.reshape(-1, 64)))
    dense_probs, dense_routed = _layer()[0].route(layer.gate(x.reshape(-1, 64)))
    assert (routed.sum(0) <= capacity).all() and (routed <= dense_routed).all()
    for e in range(4):
        kept, dropped = dense_probs[routed[:, e], e], dense_probs[dense_routed[:, e] & ~routed[:, e], e]
        assert dropped.numel() == 0 or kept.min() >= dropped.max()
    assert torch.equal(probs, dense_probs * routed)  # kept pairs keep their probability, unrenormalised


def test_large_capacity_drops_nothing():
    layer, x = _layer(moe_capacity_factor=4.0)
    assert expert_capacity(30, layer.cfg) is None
    flat = layer.gate(x.reshape(-1, 64))
    assert torch.equal(layer.route(flat)[1], _layer()[0].route(flat)[1])


def test_pre_softmax_probabilities_are_the_full_softmax_not_renormalised():
    layer, x = _layer(moe_top_k=1, moe_router_pre_softmax=True)
    logits = layer.gate(x.reshape(-1, 64))
    probs, _ = layer.route(logits)
    torch.testing.assert_close(probs.sum(-1), logits.softmax(-1).max(-1).values)


def test_router_losses_enter_the_loss_per_routed_token_and_train_the_router():
    torch.manual_seed(0)
    model = SetDiffusionTransformer(debug_config(**MOE, moe_z_loss_coeff=1e-3))
    tokens = torch.randint(0, 60, (2, 12))
    out = model.loss(tokens, Staggered(d=4), generator=torch.Generator().manual_seed(0))
    nll = out.nll_sum.sum() / out.num_tokens.sum()
    stats = model.router_stats()
    assert sorted(stats) == [0, 1]  # debug has 2 layers, both MoE at moe_layer_freq 1
    # Layer 0 routes both streams (2 x 24 tokens), the last layer the query rows only (24).
    assert [int(s.tokens_per_expert.sum()) for s in stats.values()] == [2 * 48, 2 * 24]
    expected = sum((1e-2 * s.load_balancing_loss + 1e-3 * s.z_loss) * n for s, n in zip(stats.values(), (48, 24)))
    torch.testing.assert_close(out.loss - nll, expected / out.num_tokens.sum())
    out.loss.backward()
    assert model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_active_parameters_count_top_k_experts():
    cfg = debug_config(**MOE, num_shared_experts=1)
    model = SetDiffusionTransformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    expert = 3 * 64 * 32
    assert cfg.num_params() - cfg.num_params(active=True) == cfg.num_layers * 2 * expert


@pytest.mark.parametrize(
    "changes,fragment",
    [
        (dict(num_experts=4, moe_top_k=5), "moe_top_k must lie in [1, num_experts=4]"),
        (dict(num_experts=4, moe_layer_freq=0), "moe_layer_freq must be >= 1"),
        (dict(num_experts=4, moe_layer_freq=[0, 0]), "at least one 1"),
        (dict(num_experts=-1), "num_experts must be >= 0"),
    ],
)
def test_bad_moe_configs_are_refused(changes, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        debug_config(**changes)
