"""The megatron-core engine end to end: `setdiff train RECIPE` as a user runs it."""

import json
import subprocess
from pathlib import Path

import pytest

from tests.cli_runs import setdiff

pytestmark = pytest.mark.multiproc

TINY = str(Path(__file__).parents[3] / "recipes" / "tiny-cpu.yaml")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """One prepared built-in corpus for every run of this module."""
    return tmp_path_factory.mktemp("data")


def run_train(run_dir: Path, data_cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [f"checkpoint.dir={run_dir}", f"data.cache_dir={data_cache}", "log.tensorboard=false", *overrides]
    return setdiff("train", TINY, *args, check=False)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 30 s; two-process runs train in the checkpoint and SLURM tests
def test_two_process_run_lowers_validation_loss(tmp_path, data_cache):
    out = run_train(tmp_path / "run", data_cache, "train.steps=40", "eval.interval=40", "checkpoint.interval=40")
    assert out.returncode == 0, out.stderr[-3000:]
    valid = [m["valid/loss"] for m in metrics(tmp_path / "run") if "valid/loss" in m]
    assert len(valid) == 2 and valid[1] < valid[0] - 1.0, valid
    assert "checkpoint:" in out.stdout and (tmp_path / "run" / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize(
    "async_save",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # async: 18 s
    ids=["sync", "async"],
)
def test_resume_continues_exactly(tmp_path, data_cache, async_save):
    """Resuming from the step-2 checkpoint of a 4-step run reproduces its steps 3 and 4 bit for
    bit, also when that checkpoint was written in the background while step 3 trained."""
    import shutil

    args = [
        "train.steps=4",
        "launch.nproc_per_node=1",
        "parallel.global_batch_size=8",
        "log.interval=1",
        "eval.interval=100",
        "checkpoint.interval=2",
        f"checkpoint.async_save={str(async_save).lower()}",
    ]
    first = run_train(tmp_path / "run", data_cache, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = {m["step"]: m["train/loss"] for m in metrics(tmp_path / "run") if "train/loss" in m}
    saves = [m for m in metrics(tmp_path / "run") if "checkpoint/step" in m]
    assert [m["checkpoint/step"] for m in saves] == [2, 4]
    assert all(m["checkpoint/write_s"] >= m["checkpoint/blocked_s"] > 0 for m in saves)
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step_00000004")  # as if the run had died after step 3
    (checkpoints / "latest").write_text("step_00000002\n")
    resumed = run_train(tmp_path / "run", data_cache, *args)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    again = [m for m in metrics(tmp_path / "run") if "train/loss" in m][4:]
    assert [m["step"] for m in again] == [3, 4]
    assert [m["train/loss"] for m in again] == [losses[3], losses[4]]  # bitwise


@pytest.mark.slow  # 45 s; document masks train in the default suite through packed supervised rows
def test_document_mask_trains(tmp_path, data_cache):
    """data.document_mask end to end in one process, on the corpus of short documents (about four
    per window): document ids from its EOD tokens."""
    out = run_train(
        tmp_path / "run",
        data_cache,
        "data.document_mask=true",
        "data.datasets=[{path: reasoning}]",
        "train.steps=3",
        "launch.nproc_per_node=1",
        "parallel.global_batch_size=8",
        "log.interval=1",
        "eval.interval=100",
        "checkpoint.interval=100",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [m["train/loss"] for m in metrics(tmp_path / "run") if "train/loss" in m]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses), losses


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["data.datasets=[{path: /nonexistent/owt}]"], "data.datasets.0.path: no indexed dataset"),
        (["launch.nproc_per_node=1", "parallel.tp=2"], "does not divide the 1 processes"),
        (["model.backend=te"], "needs a GPU"),
        (["train.fp8=hybrid"], "train.fp8"),
    ],
)
def test_bad_input_fails_fast_with_one_line(tmp_path, data_cache, overrides, fragment):
    out = run_train(tmp_path / "run", data_cache, *overrides)
    assert out.returncode == 2 and fragment in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_loss_follows_the_recipe_policy(tmp_path, data_cache, policy):
    """An absurd learning rate without clipping sends the weights to inf within a step or two."""
    out = run_train(
        tmp_path / "run",
        data_cache,
        "launch.nproc_per_node=1",
        "parallel.global_batch_size=8",
        "train.steps=4",
        "train.warmup_steps=0",
        "train.lr=1e30",
        "train.clip_grad=0",
        "train.schedule=constant",
        "train.min_lr=1e30",
        f"train.nan_policy={policy}",
        "eval.interval=100",
    )
    if policy == "stop":
        assert out.returncode == 2 and "train.nan_policy=stop" in out.stderr and "Traceback" not in out.stderr, (
            out.stderr[-2000:]
        )
    else:
        assert out.returncode == 0, out.stderr[-2000:]
        assert "step skipped (train.nan_policy=skip)" in out.stdout + out.stderr
