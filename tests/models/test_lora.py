"""LoRA on the torch body (models/lora.py): a fresh adapter changes nothing, the merged weights are
the adapted model, only adapters train, and the recipe's one-line refusals."""

from pathlib import Path

import pytest
import torch

from setdiff_megatron.models.lora import (
    TARGETS,
    LoraSpec,
    adapt_torch_model,
    adapter_state,
    is_adapter_key,
    merge_adapters,
)
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.recipes import RecipeError, load_recipe, validate_recipe
from tests.conftest import debug_config, dit_config, randomized

REASONING = Path(__file__).parents[2] / "recipes" / "tiny-reasoning.yaml"


def _model(cfg) -> SetDiffusionTransformer:
    torch.manual_seed(0)
    model = SetDiffusionTransformer(cfg)
    model.load_state_dict(randomized(model.state_dict()))
    return model


def _inputs(length: int = 10):
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(0, 60, (2, length), generator=gen)
    positions = torch.stack([torch.randperm(length, generator=gen) for _ in range(2)])
    return clean, torch.full_like(clean, 63), positions


def _base(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if not is_adapter_key(k)}


@pytest.mark.parametrize("cfg", [debug_config(), dit_config()], ids=["swiglu_gqa", "dit"])
def test_a_fresh_adapter_changes_nothing_and_merged_weights_are_the_adapted_model(cfg):
    model = _model(cfg)
    reference = model(*_inputs())
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    adapt_torch_model(model, spec, seed=1)
    assert torch.equal(model(*_inputs()), reference)  # B = 0
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    adapted = model(*_inputs())
    assert (adapted - reference).abs().max() > 1e-2  # the adapters act
    plain = SetDiffusionTransformer(cfg)
    plain.load_state_dict(merge_adapters(_base(model), adapter_state(model), spec, cfg))
    assert (plain(*_inputs()) - adapted).abs().max() <= 1e-5


def test_only_adapters_train_and_one_seed_draws_them():
    cfg = debug_config()
    spec = LoraSpec(rank=2, alpha=2.0, targets=("qkv", "mlp_output"))
    model, again = _model(cfg), _model(cfg)
    adapt_torch_model(model, spec, seed=5)
    adapt_torch_model(again, spec, seed=5)
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trained == sorted(f"layers.{i}.lora_{t}.{m}" for i in range(2) for t in spec.targets for m in "AB")
    assert all(torch.equal(v, adapter_state(again)[k]) for k, v in adapter_state(model).items())
    base = _base(model)
    clean, query, positions = _inputs()
    model(clean, query, positions).logsumexp(-1).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    assert all(torch.equal(v, base[k]) for k, v in _base(model).items())


def test_merging_refuses_adapters_the_spec_does_not_name():
    cfg = debug_config()
    model = _model(cfg)
    adapt_torch_model(model, LoraSpec(2, 2.0, TARGETS), seed=0)
    with pytest.raises(KeyError, match="does not name"):
        merge_adapters(_base(model), adapter_state(model), LoraSpec(2, 2.0, ("qkv",)), cfg)
    with pytest.raises(KeyError, match="no adapter"):
        merge_adapters(_base(model), {}, LoraSpec(2, 2.0, ("qkv",)), cfg)


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["model.init_from=null"], "model.lora: adapters train on a base model: set model.init_from"),
        (["parallel.tp=2"], "model.lora: the megatron engine adapts whole layers on one stage"),
        (["parallel.pp=2"], "model.lora: the megatron engine adapts whole layers on one stage"),
        (["engine=deepspeed", "parallel.zero_stage=3"], "model.lora: ZeRO-3 partitions the frozen weights"),
        (["train.ema_decay=0.999"], "model.lora: no average of the weights is kept for adapters"),
        (["model.num_experts=4", "model.moe_intermediate_size=64"], "model.lora: adapters go on dense layers"),
    ],
)
def test_settings_lora_cannot_run_are_refused_in_one_line(overrides, error):
    recipe = load_recipe(REASONING, ["model.lora.rank=4", *overrides])
    errors = validate_recipe(recipe, world_size=4, has_gpu=True, check_paths=False)
    assert any(e.startswith(error) and "\n" not in e for e in errors), errors


@pytest.mark.parametrize("targets", ["[]", "[qkv,qkv]", "[lm_head]"])
def test_lora_targets_are_checked_when_the_recipe_loads(targets):
    with pytest.raises(RecipeError, match="model.lora.targets"):
        load_recipe(REASONING, [f"model.lora.targets={targets}"])
