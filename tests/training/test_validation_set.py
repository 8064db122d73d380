"""The validation loss depends on the weights and the validation set only (training/data_pipeline.py,
`valid_batches`): every layout sees the same held-out samples with the same orders and noise, so
curves compare across runs and across a resume on another layout."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from setdiff_megatron.core.streams import concat_batches
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.training.data_pipeline import DataLoaders, TrainingData

TINY = Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml"
LAYOUTS = [(1, 16), (1, 4), (2, 8), (2, 2), (4, 4), (8, 1)]  # (data-parallel ranks, micro-batch size)


def _samples(count: int, length: int = 32) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        prompt = torch.zeros(length, dtype=torch.bool)
        prompt[: i % 5] = True
        pad = torch.zeros(length, dtype=torch.bool)
        pad[length - i % 3 :] = True
        out.append({"tokens": torch.randint(2, 60, (length,), generator=gen), "prompt_mask": prompt, "pad_mask": pad})
    return out


def _whole_validation_set(family: list[str], dp: int, mbs: int):
    recipe = load_recipe(TINY, [*family, f"parallel.micro_batch_size={mbs}", "parallel.global_batch_size=16"])
    data = TrainingData(SimpleNamespace(mask_id=63, eod=1), train=_samples(64), valid=_samples(64))
    batches = []
    for rank in range(dp):
        batches += DataLoaders(recipe, data, dp_rank=rank, dp_size=dp).valid_batches(recipe.eval.batches)
    assert all(b.query_tokens.shape[0] == mbs for b in batches)
    return concat_batches(batches)


@pytest.mark.parametrize(
    "family",
    [[], ["method.family=mdlm", "method.antithetic=true"], ["method.family=bd3lm", "method.block_size=4"]],
    ids=["set_diffusion", "mdlm", "bd3lm"],
)
def test_every_layout_sees_the_same_samples_orders_and_noise(family):
    reference = _whole_validation_set(family, *LAYOUTS[0])
    assert reference.query_tokens.shape[0] == 4 * 16  # eval.batches global batches
    for dp, mbs in LAYOUTS[1:]:
        got = _whole_validation_set(family, dp, mbs)
        for name, value in vars(reference).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(got, name), value), f"{name} differs at dp {dp}, micro-batch {mbs}"


def _step_rows(family: list[str], dp: int, mbs: int, steps: int = 2) -> dict[tuple, dict]:
    """Every row of the first `steps` training steps over all ranks, by its tokens (unique here)."""
    recipe = load_recipe(TINY, [*family, f"parallel.micro_batch_size={mbs}", "parallel.global_batch_size=16"])
    data = TrainingData(SimpleNamespace(mask_id=63, eod=1), train=_samples(64), valid=None)
    rows = {}
    for rank in range(dp):
        loaders = DataLoaders(recipe, data, dp_rank=rank, dp_size=dp)
        for _ in range(steps):
            for batch in loaders.next_step():
                for r in range(batch.query_tokens.shape[0]):
                    key = tuple(batch.targets[r].tolist())
                    rows[key] = {k: v[r] for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    return rows


@pytest.mark.parametrize(
    "family", [[], ["method.family=mdlm", "method.antithetic=true"]], ids=["set_diffusion", "mdlm_antithetic"]
)
def test_a_training_step_draws_the_same_for_each_sample_on_every_layout(family):
    """A step's samples are the same on every layout (megatron's order); their orders and noise
    are too, so the losses of one step agree across layouts up to the reductions' rounding."""
    reference = _step_rows(family, *LAYOUTS[0])
    assert len(reference) == 32
    for dp, mbs in LAYOUTS[1:]:
        got = _step_rows(family, dp, mbs)
        assert got.keys() == reference.keys()
        for key, fields_ in reference.items():
            for name, value in fields_.items():
                assert torch.equal(got[key][name], value), f"{name} differs at dp {dp}, micro-batch {mbs}"
