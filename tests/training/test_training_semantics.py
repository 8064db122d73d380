"""The reference's training semantics as recipe choices: composer's DecoupledAdamW and the average
of the weights (per-row loss: tests/core/test_streams_and_loss.py; both engines end to end:
tests/training/test_reference_semantics_runs.py)."""

import math

import pytest
import torch

from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.training.engines.deepspeed_config import build_optimizer
from setdiff_megatron.training.lr_schedule import build_lr_scheduler
from setdiff_megatron.training.weight_average import Share, WeightAverage
from tests.conftest import debug_config
from tests.models.megatron_cases import ROOT

pytestmark = pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed")

RECIPE = ROOT / "recipes" / "tiny-cpu-deepspeed.yaml"
DECOUPLED = [
    "train.optimizer=decoupled_adamw",
    "train.lr=1e-2",
    "train.min_lr=1e-3",
    "train.weight_decay=0.05",
    "train.warmup_steps=2",
    "train.betas=[0.9, 0.98]",
    "train.eps=1e-8",
]


def composer_step(params, grads, state, *, lr, initial_lr, betas, eps, weight_decay) -> None:
    """composer 0.32.1's DecoupledAdamW update of each parameter (ref-baselines.md §3(b)), in
    place: decay by the schedule's factor first, then Adam with eps added after the square root's
    bias correction, the bias corrections in Python floats."""
    beta1, beta2 = betas
    for name, p in params.items():
        s = state.setdefault(name, {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
        s["step"] += 1
        if weight_decay != 0:
            p.mul_(1 - (lr / initial_lr) * weight_decay)
        s["m"].mul_(beta1).add_(grads[name], alpha=1 - beta1)
        s["v"].mul_(beta2).addcmul_(grads[name], grads[name], value=1 - beta2)
        bias1, bias2 = 1 - beta1 ** s["step"], 1 - beta2 ** s["step"]
        denom = (s["v"].sqrt() / math.sqrt(bias2)).add_(eps)
        p.addcdiv_(s["m"], denom, value=-lr / bias1)


def test_a_decoupled_adamw_step_is_composers_update():
    """train.optimizer=decoupled_adamw: every weight (norms and biases too) shrinks by
    (lr_t / lr) x weight_decay, then Adam, through warm-up and decay, to 1e-7."""
    from setdiff_megatron.models.torch_model import SetDiffusionTransformer

    recipe = load_recipe(RECIPE, DECOUPLED)
    torch.manual_seed(0)
    model = SetDiffusionTransformer(debug_config())
    optimizer = build_optimizer(recipe, model)
    scheduler = build_lr_scheduler(recipe, optimizer, 6)
    assert len(optimizer.param_groups) == 1 and len(optimizer.param_groups[0]["params"]) == len(
        list(model.parameters())
    )
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    state, gen, lrs = {}, torch.Generator().manual_seed(1), []
    for _ in range(6):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        lrs.append(lr := optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step(increment=1)
        composer_step(expected, grads, state, lr=lr, initial_lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.05)
    assert lrs[0] == 0.0 and 0.0 < lrs[1] < lrs[2] == 1e-2 and lrs[-1] < 1e-2  # warm-up, peak, decay
    worst = max((p.detach() - expected[n]).abs().max().item() for n, p in model.named_parameters())
    assert worst <= 1e-7, worst
    norm = model.norm.weight  # a 1-D weight megatron's rule leaves undecayed
    assert (norm.detach() - 1).abs().max() > 1e-3


def test_megatron_adamw_keeps_its_rule():
    """train.optimizer=adamw (the default) is megatron's: decay lr_t x weight_decay on matrices
    only; norm weights and biases in a group without decay."""
    from setdiff_megatron.models.torch_model import SetDiffusionTransformer

    recipe = load_recipe(RECIPE, [*DECOUPLED, "train.optimizer=adamw"])
    optimizer = build_optimizer(recipe, SetDiffusionTransformer(debug_config()))
    build_lr_scheduler(recipe, optimizer, 6)
    decayed, undecayed = optimizer.param_groups
    assert all(p.dim() > 1 for p in decayed["params"]) and all(p.dim() == 1 for p in undecayed["params"])
    assert decayed["weight_decay"] == 0.05 and undecayed["weight_decay"] == 0.0


def test_the_average_starts_at_the_first_steps_weights_and_follows_composers_rule():
    weights = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    share = Share("w", weights, weights.shape, weights.data)
    average = WeightAverage(0.75)
    assert average.record() is None
    average.update([share])  # the first step's weights, copied
    with torch.no_grad():
        weights.add_(4.0)
    average.update([share])
    assert average.whole(share).tolist() == [2.0, 3.0, 4.0, 5.0]  # 0.75 x w + 0.25 x (w + 4)
    with average.swapped_in([share]):
        assert weights.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert weights.tolist() == [5.0, 6.0, 7.0, 8.0] and average.record() == {"decay": 0.75}
    resumed = WeightAverage(0.75)
    resumed.load([share], lambda s: average.whole(s))
    assert torch.equal(resumed.whole(share), average.whole(share))


def test_off_means_no_average():
    assert not load_recipe(RECIPE, ["train.ema_decay=0"]).train.ema
    assert not load_recipe(RECIPE).train.ema
    assert load_recipe(RECIPE, ["train.ema_decay=0.9999"]).train.ema_decay == 0.9999
