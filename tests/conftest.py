"""Shared fixtures: tiny models that build in milliseconds on a CPU, nothing downloaded."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from setdiff_megatron.models.config import DIT_BODY, FLAVORS, ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from tests.cli_runs import setdiff


def debug_config(**changes) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 64, "mask_token_id": 63, **FLAVORS["debug"], **changes})


def dit_config(**changes) -> ModelConfig:
    """debug_config in the reference DiT's layout (LayerNorm, GELU MLP with biases, untied output
    layer with a bias, plain multi-head attention)."""
    return debug_config(**{**DIT_BODY, "num_kv_heads": None, **changes})


def randomized(state_dict: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """`state_dict` with its 1-D tensors (norm weights, biases) and its all-zero ones (adaLN's
    modulations) drawn at random: a fresh model's ones and zeros would hide a bias, norm or
    modulation mapped to the wrong place."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.dim() == 1 or not v.any() else v
        for k, v in state_dict.items()
    }


@pytest.fixture(scope="session", autouse=True)
def machine_records_in_a_temporary_directory(tmp_path_factory) -> None:
    """What the code records on the machine (sampling/step_compiler.py's compile costs) goes to a
    directory of the test session, for every process the tests start, not to the user's home."""
    os.environ["SETDIFF_CACHE_DIR"] = str(tmp_path_factory.mktemp("setdiff-cache"))


@pytest.fixture
def debug_model() -> SetDiffusionTransformer:
    torch.manual_seed(0)
    return SetDiffusionTransformer(debug_config()).double()


@pytest.fixture(scope="session")
def trained_launch(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(run directory, the finished `setdiff train` process, its stdout and stderr pipes): 20
    steps of the tiny-cpu recipe at TP=2, 2 processes started by `setdiff train` itself. The
    built-in corpus is prepared in the data cache the training tests of the session share."""
    run = tmp_path_factory.mktemp("trained") / "run"
    data = tmp_path_factory.getbasetemp() / "checkpoint-tests-data"
    recipe = Path(__file__).parents[1] / "recipes" / "tiny-cpu.yaml"
    proc = setdiff(
        "train",
        recipe,
        f"checkpoint.dir={run}",
        f"data.cache_dir={data}",
        "parallel.tp=2",
        "parallel.global_batch_size=8",
        "train.steps=20",
        "checkpoint.interval=20",
        "eval.interval=1000",
        "log.tensorboard=false",
    )
    return run, proc


@pytest.fixture(scope="session")
def clean_site(tmp_path_factory) -> Path:
    """A Python path with torch and transformers only, for what a Hugging Face user runs."""
    from tests.hf.clean_env import make_clean_site

    return make_clean_site(tmp_path_factory.mktemp("clean") / "site")


@pytest.fixture(scope="session")
def trained_run(trained_launch) -> Path:
    """The run directory of `trained_launch`, for the jobs that load checkpoints (sampling,
    evaluation, export)."""
    return trained_launch[0]


@pytest.fixture(scope="session")
def single_results(tmp_path_factory) -> dict:
    """The megatron body in one process (tests/models/megatron_single_worker.py), run once per session."""
    from tests.models.megatron_cases import run_worker

    return run_worker("tests.models.megatron_single_worker", tmp_path_factory.mktemp("megatron") / "single.json")


@pytest.fixture(scope="session")
def parallel_results(tmp_path_factory) -> dict:
    """The megatron body over 2 ranks at each layout (tests/models/megatron_parallel_worker.py), run once."""
    from tests.models.megatron_cases import run_worker

    return run_worker(
        "tests.models.megatron_parallel_worker", tmp_path_factory.mktemp("megatron") / "parallel.json", nproc=2
    )


MAIN_JOB_PROBLEMS = 60
"""Held-out problems the showcase scores: enough to tell the model from the trivial baseline
(about 4 %) with room to spare, few enough to keep the test short."""


CACHE_ENV = "SETDIFF_TEST_CACHE"
"""A directory shared by the pytest invocations of one CI run (.ci/run sets it): the main job is
trained once for the default suite and its slow tests, not once per invocation."""


@pytest.fixture(scope="session")
def main_job(tmp_path_factory) -> tuple[Path, str, dict]:
    """(run directory, console output, logs/showcase.json) of the main job, as the README runs it
    (from the repository root), with a smaller held-out problem count; trained once per
    $SETDIFF_TEST_CACHE where that is set, and read-only to every test."""
    shared = os.environ.get(CACHE_ENV)
    home = Path(shared) / "main-job" if shared else tmp_path_factory.mktemp("main-job")
    run, console = home / "run", home / "console.txt"
    if not console.exists():  # not trained yet, or a half-trained run of an interrupted invocation
        shutil.rmtree(run, ignore_errors=True)
        home.mkdir(parents=True, exist_ok=True)
        proc = setdiff(
            "train",
            "recipes/tiny-reasoning.yaml",
            f"checkpoint.dir={run}",
            f"eval.showcase_problems={MAIN_JOB_PROBLEMS}",
        )
        console.write_text(proc.stdout)
    return run, console.read_text(), json.loads((run / "logs" / "showcase.json").read_text())
