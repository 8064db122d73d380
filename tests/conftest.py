"""Shared fixtures: tiny models that build in milliseconds on a CPU, nothing downloaded."""

import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A run directory of 20 steps of the tiny-cpu recipe at TP=2 (2 processes), for the jobs
    that load checkpoints (sampling, evaluation, export). The built-in corpus is prepared in the
    data cache the training tests of the session share."""
    run = tmp_path_factory.mktemp("trained") / "run"
    data = tmp_path_factory.getbasetemp() / "checkpoint-tests-data"
    recipe = Path(__file__).parents[1] / "recipes" / "tiny-cpu.yaml"
    proc = subprocess.run([sys.executable, "-m", "setdiff_megatron.cli", "train", str(recipe), f"checkpoint.dir={run}",
                           f"data.cache_dir={data}", "parallel.tp=2", "parallel.global_batch_size=8",
                           "train.steps=20", "checkpoint.interval=20", "eval.interval=1000",
                           "log.tensorboard=false"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run
