"""Supervised records end to end, as a user trains on them: `setdiff train` on the built-in
reasoning corpus's records, each engine and layout against one process, and the GSM8K pipeline
in miniature (an AR model exported to Hugging Face format, then adapted)."""

import json
from pathlib import Path

import pytest

from tests.cli_runs import setdiff

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny-reasoning.yaml"
# 3 steps of 8 rows in fp32, a loss at every step: the parity tolerances are fp32's. The showcase
# scores 20 held-out problems instead of 250.
SMALL = (
    "train.steps=3",
    "parallel.micro_batch_size=4",
    "parallel.global_batch_size=8",
    "log.interval=1",
    "eval.interval=3",
    "eval.batches=2",
    "checkpoint.interval=3",
    "log.tensorboard=false",
    "train.warmup_steps=1",
    "eval.showcase_problems=20",
)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "checkpoint-tests-data"  # the built-in corpora, shared


def train(run_dir: Path, data_cache: Path, *overrides: str, recipe: Path = RECIPE) -> list[dict]:
    setdiff("train", recipe, f"checkpoint.dir={run_dir}", f"data.cache_dir={data_cache}", *SMALL, *overrides)
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def losses(metrics: list[dict], key: str = "train/loss") -> list[float]:
    return [m[key] for m in metrics if key in m]


@pytest.mark.multiproc
def test_packed_supervised_rows_train_in_one_process(tmp_path, data_cache):
    """The main job's recipe, from its shipped AR base (assets/reasoning-ar-base)."""
    metrics = train(tmp_path / "run", data_cache, "launch.nproc_per_node=1")
    assert len(losses(metrics)) == 3 and all(0 < v < 10 for v in losses(metrics))
    assert len(losses(metrics, "valid/loss")) == 2  # steps 0 and 3, on response tokens only


@pytest.fixture(scope="module")
def start(tmp_path_factory, data_cache) -> Path:
    """Weights every parity run starts from (megatron initialises TP shards with their own seeds)."""
    run = tmp_path_factory.mktemp("supervised") / "start"
    train(run, data_cache, "launch.nproc_per_node=1", "train.steps=1", "checkpoint.interval=1")
    return run


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.tp=2", "parallel.sequence_parallel=true"),
        ("parallel.pp=2",),
        ("engine=deepspeed", "launch.nproc_per_node=1", "parallel.zero_stage=0"),
    ],
    ids=["tp2", "pp2", "deepspeed"],
)
def test_supervised_rows_train_as_one_megatron_process(tmp_path, data_cache, start, layout):
    """The same weights, rows and orders (one data-parallel replica everywhere): TP = 2 (SP) and
    PP = 2 on 2 processes, and the DeepSpeed engine's torch body, equal one megatron process step
    by step."""
    common = ("train.precision=fp32", f"model.init_from={start}")
    reference = losses(train(tmp_path / "one", data_cache, "launch.nproc_per_node=1", *common))
    got = losses(train(tmp_path / "other", data_cache, *common, *layout))
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, reference)) <= 2e-5, (got, reference)


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_imported_ar_model_adapts_to_set_diffusion(tmp_path, data_cache):
    """The main job's pipeline with a base made here on a smoke budget: an AR model pretrained on
    packed windows, exported to Hugging Face format, starts the supervised set diffusion run."""
    ar = tmp_path / "ar"
    train(ar, data_cache, "launch.nproc_per_node=1", recipe=ROOT / "recipes" / "study" / "packed" / "ar.yaml")
    hf = tmp_path / "ar-hf"
    setdiff("convert", "to-hf", ar, hf, timeout=600)
    adapt = [f"checkpoint.dir={tmp_path / 'adapt'}", f"data.cache_dir={data_cache}", f"model.init_from={hf}", *SMALL]
    out = setdiff("train", RECIPE, *adapt)
    assert f"initialised from set diffusion Hugging Face export {hf}" in out.stdout
    assert f"its initial weights: set diffusion Hugging Face export {hf} (4 x 128)" in out.stdout
    assert "held-out accuracy on 20 test problems" in out.stdout
