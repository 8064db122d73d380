"""Shared fixtures: tiny models that build in milliseconds on a CPU, nothing downloaded."""

import pytest
import torch

from setdiff_megatron.models.config import FLAVORS, ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer


def debug_config(**changes) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 64, "mask_token_id": 63, **FLAVORS["debug"], **changes})


@pytest.fixture
def debug_model() -> SetDiffusionTransformer:
    torch.manual_seed(0)
    return SetDiffusionTransformer(debug_config()).double()
