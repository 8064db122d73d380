"""data.document_mask reaches the micro-batches: DataLoaders carry document ids in rank order."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from setdiff_megatron.core.streams import document_ids
from setdiff_megatron.recipes.recipe_files import load_recipe
from setdiff_megatron.training.data_pipeline import DataLoaders, TrainingData

TINY = Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml"
MASK, EOD, LENGTH = 63, 62, 128


def _samples(count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, 60, (LENGTH,), generator=gen)
        tokens[torch.randint(0, LENGTH, (3,), generator=gen)] = EOD
        out.append(
            {
                "tokens": tokens,
                "prompt_mask": torch.zeros(LENGTH, dtype=torch.bool),
                "pad_mask": torch.zeros(LENGTH, dtype=torch.bool),
            }
        )
    return out


@pytest.mark.parametrize("document_mask", [False, True])
def test_loaders_carry_document_ids_when_asked(document_mask):
    recipe = load_recipe(TINY, [f"data.document_mask={str(document_mask).lower()}", "parallel.global_batch_size=8"])
    samples = _samples(8)
    data = TrainingData(tokenizer=SimpleNamespace(mask_id=MASK, eod=EOD), train=samples, valid=None)
    (batch,) = DataLoaders(recipe, data, dp_rank=0, dp_size=1).next_step()
    if not document_mask:
        assert batch.document_ids is None
        return
    tokens = torch.stack([s["tokens"] for s in samples])
    assert torch.equal(batch.document_ids, document_ids(tokens, EOD).gather(1, batch.position_ids))
