"""The reference's training semantics in a megatron-engine run, as a user starts it: per-row loss,
composer's DecoupledAdamW and an EMA of the weights, on 2 processes with the distributed
optimizer (so each rank averages its shard of the weights). The DeepSpeed engine's counterpart:
tests/training/engines/test_deepspeed.py (test_reference_semantics_train_as_the_reference_does)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from setdiff_megatron.checkpoint.resolve import describe
from setdiff_megatron.core.loss import token_nll
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sources.megatron_checkpoints import torch_weights
from setdiff_megatron.sources.read import read_source
from setdiff_megatron.training.data_pipeline import DataLoaders, prepare_data
from setdiff_megatron.training.objective import Objective
from tests.training.test_checkpoint_runs import run_train

DECAY = 0.8
ARGS = (  # over test_checkpoint_runs.py's
    "train.loss_normalization=per_row",
    "train.optimizer=decoupled_adamw",
    "train.weight_decay=0.01",
    f"train.ema_decay={DECAY}",
    "train.steps=4",
    "parallel.micro_batch_size=4",
    "parallel.global_batch_size=16",
    "eval.interval=2",
    "checkpoint.interval=1",
    "checkpoint.keep_last_n=4",
)


def metrics(run_dir: Path, key: str) -> dict[int, float]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m[key] for m in map(json.loads, lines) if key in m}


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def shard_hashes(checkpoint: Path) -> dict[str, str]:
    """The sha256 of each dist_checkpointing data file (the manifest's)."""
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    return {name: f["sha256"] for name, f in files.items() if name.endswith(".distcp")}


def validation_loss(run_dir: Path, weights: dict[str, torch.Tensor]) -> float:
    """The run's validation loss (per row, both data-parallel ranks' batches) of `weights` in the
    torch model, in this process."""
    source = read_source(run_dir, weights=False)
    r = source.recipe
    data = prepare_data(
        r,
        num_train_samples=r.train.steps * r.parallel.global_batch_size,
        num_valid_samples=r.eval.batches * r.parallel.micro_batch_size * 2,
        is_first_rank=True,
    )
    model = SetDiffusionTransformer(source.config)
    model.load_state_dict(weights)
    objective, total, rows = Objective.of(r), 0.0, 0
    with torch.no_grad():
        for rank in range(2):
            for b in DataLoaders(r, data, dp_rank=rank, dp_size=2).valid_batches(r.eval.batches):
                w = objective(b)
                logits = model(b.clean_tokens, b.query_tokens, b.position_ids, b.valid_len, b.document_ids)
                total += w.apply(token_nll(logits, b.targets, source.config.mask_token_id)).sum().item()
                rows += int(w.denominator)
    return total / rows


@pytest.mark.slow  # 38 s; the average's and DecoupledAdamW's rules have unit tests (test_training_semantics.py)
@pytest.mark.multiproc
@pytest.mark.filterwarnings("ignore")
def test_the_ema_follows_composer_is_evaluated_exported_and_resumed_bitwise(tmp_path, data_cache):
    run = tmp_path / "run"
    first = run_train(run, data_cache, *ARGS)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = metrics(run, "train/loss")

    # composer's EMA: the weights after the first step, then decay x average + (1 - decay) x weights
    # after every step, here from each rank's shard of the distributed optimizer's weights.
    source = read_source(step_dir(run, 4), weights=False)
    assert source.averaged and "EMA weights" in source.describe()
    weights = [torch_weights(step_dir(run, s), source.config) for s in range(1, 5)]
    averages = [torch_weights(step_dir(run, s), source.config, ema=True) for s in range(1, 5)]
    assert all(torch.equal(averages[0][k], weights[0][k]) for k in weights[0])
    for before, average, now in zip(averages, averages[1:], weights[1:]):
        assert all(torch.equal(average[k], before[k] * DECAY + now[k] * (1 - DECAY)) for k in now)
    assert any((averages[3][k] - weights[3][k]).abs().max() > 1e-4 for k in weights[3])
    assert f"EMA of the weights (decay {DECAY}" in describe(run)[0]

    # Validation runs on the average (per row, as training), and swaps the weights back after.
    assert validation_loss(run, averages[3]) == pytest.approx(metrics(run, "valid/loss")[4], rel=1e-6)

    # Resumed from step 2: steps 3 and 4 (losses, and every shard of weights, optimizer state and
    # average), bit for bit.
    kept = {s: step_dir(run, s).with_name(f"kept_{s}") for s in (3, 4)}
    for s, where in kept.items():
        shutil.move(step_dir(run, s), where)
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    resumed = run_train(run, data_cache, *ARGS)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    again = [m for m in map(json.loads, (run / "logs" / "metrics.jsonl").read_text().splitlines()) if "train/loss" in m]
    assert [(m["step"], m["train/loss"]) for m in again[4:]] == [(3, losses[3]), (4, losses[4])]
    for s, where in kept.items():
        assert shard_hashes(step_dir(run, s)) == shard_hashes(where), s
