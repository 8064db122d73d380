"""The DeepSpeed engine on 2 CPU processes: ZeRO 0-3 against single-process training, against
the megatron engine, its checkpoints (consolidation, exact resume in a new engine and, slow,
after SIGTERM through the launcher), and `setdiff train recipes/tiny-cpu-deepspeed.yaml` as a
user runs it (slow).

Tolerances, fp32 throughout (seen on 2 cores in brackets): ZeRO vs one process 1e-6 absolute
on per-token losses of about 4.1 [<= 1e-7]; DeepSpeed vs megatron engine 2e-6 [5e-7];
resume and consolidation exact.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from setdiff_megatron.checkpoint.manifest import verify
from setdiff_megatron.distributed.signals import EXIT_REQUEUE
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.training.lr_schedule import build_lr_scheduler
from tests.cli_runs import cli, setdiff
from tests.models.megatron_cases import ROOT, run_worker
from tests.training.engines.deepspeed_megatron_worker import SCHEDULE_STEPS, SCHEDULES
from tests.training.engines.deepspeed_zero_worker import RESUMED, SEMANTICS_RUNS

pytest.importorskip("deepspeed", reason="the deepspeed extra: pip install -e .[deepspeed]")

RECIPE = ROOT / "recipes" / "tiny-cpu-deepspeed.yaml"
STEPS = 5
# Two micro-batches per rank, a loss at every step, fp32 (the parity tolerances are fp32's).
BASE = (
    "log.tensorboard=false",
    "parallel.micro_batch_size=4",
    "train.precision=fp32",
    "log.interval=1",
    "eval.interval=1000",
    "checkpoint.interval=1000",
    f"train.steps={STEPS}",
)
ZERO_RUNS = ["stage0", "stage1", "stage2", "stage3", "stage2_offload"]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """The built-in corpus of recipes/tiny-cpu.yaml, shared with the megatron checkpoint tests."""
    return tmp_path_factory.getbasetemp() / "checkpoint-tests-data"


def train_args(run_dir: Path, data_cache: Path, *overrides: str) -> list[str]:
    """`setdiff train` of the recipe into `run_dir`, BASE and `overrides` over it."""
    return ["train", str(RECIPE), f"checkpoint.dir={run_dir}", f"data.cache_dir={data_cache}", *BASE, *overrides]


def losses(run_dir: Path, key: str = "train/loss") -> list[tuple[int, float]]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m[key]) for m in map(json.loads, lines) if key in m]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_cache) -> Path:
    """An uninterrupted 5-step run of the recipe, 2 processes, ZeRO-2."""
    run_dir = tmp_path_factory.mktemp("deepspeed") / "straight"
    setdiff(*train_args(run_dir, data_cache))
    return run_dir


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory) -> dict:
    return run_worker(
        "tests.training.engines.deepspeed_zero_worker",
        tmp_path_factory.mktemp("zero") / "zero.json",
        nproc=2,
        timeout=600,
    )


def megatron_worker(out: Path, data_cache: Path, *overrides: str) -> dict:
    """What deepspeed_megatron_worker.py reports of the megatron engine trained from the DeepSpeed
    engine's start on the recipe with `overrides` (the corpus prepared already)."""
    args = [f"checkpoint.dir={out.parent}", f"data.cache_dir={data_cache}", *BASE, *overrides]
    return run_worker("tests.training.engines.deepspeed_megatron_worker", out, *args, nproc=2, timeout=600)


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory, data_cache, straight) -> dict:
    """The megatron engine's losses from the DeepSpeed engine's start (after `straight`, which
    prepares the corpus)."""
    return megatron_worker(tmp_path_factory.mktemp("megatron") / "megatron.json", data_cache)


# The reference's training semantics, with a weight decay and an average that show.
SEMANTICS = (
    "train.loss_normalization=per_row",
    "train.optimizer=decoupled_adamw",
    "train.weight_decay=0.05",
    "train.ema_decay=0.5",
)


@pytest.fixture(scope="module")
def both_engines_with_the_references_semantics(tmp_path_factory, data_cache, straight) -> tuple[Path, dict]:
    """(the DeepSpeed run's directory, the megatron worker's results), both with SEMANTICS."""
    run_dir = tmp_path_factory.mktemp("deepspeed") / "semantics"
    setdiff(*train_args(run_dir, data_cache, *SEMANTICS))
    return run_dir, megatron_worker(tmp_path_factory.mktemp("megatron") / "semantics.json", data_cache, *SEMANTICS)


@pytest.mark.multiproc
@pytest.mark.parametrize("run", ZERO_RUNS)
def test_zero_stage_matches_single_process_training(zero_results, run):
    """Same weights and batches for 5 steps; recompute at stages 2 (selective) and 3 (full)."""
    got, expected = zero_results[run]["losses"], zero_results["reference"]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, expected)) <= 1e-6, (got, expected)


@pytest.mark.multiproc
def test_supervised_records_train_as_in_one_process(zero_results):
    """Rows of supervised records (two packed in a row) at ZeRO-2 on 2 ranks equal one process."""
    got, expected = zero_results["stage2_records"]["losses"], zero_results["records_reference"]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, expected)) <= 1e-6, (got, expected)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "run,optimizer",
    [
        ("stage0", "AdamW"),
        ("stage1", "DeepSpeedZeroOptimizer"),
        ("stage3", "DeepSpeedZeroOptimizer_Stage3"),
        ("stage2_offload", "DeepSpeedZeroOptimizer"),
        ("stage1_bf16", "BF16_Optimizer"),
    ],
)
def test_checkpoint_consolidates_to_the_live_fp32_weights(zero_results, run, optimizer):
    result = zero_results[run]
    assert result["optimizer"] == optimizer
    assert result["keys_match"] and result["consolidated_diff"] == 0.0 and result["dtypes"] == ["torch.float32"]


@pytest.mark.multiproc
@pytest.mark.parametrize("run", RESUMED)
def test_resume_into_a_new_engine_is_exact(zero_results, run):
    """Two more steps from the step-5 checkpoint in a new engine equal two more steps in the old
    one, and so does the average of the weights where the run keeps one."""
    assert zero_results[run]["resumed"] == zero_results[run]["continued"]
    keeps_one = run in dict(SEMANTICS_RUNS)
    assert zero_results[run].get("ema_resumed_bitwise") is (True if keeps_one else None)


@pytest.mark.multiproc
@pytest.mark.parametrize("run", [name for name, _ in SEMANTICS_RUNS])
def test_reference_semantics_train_as_the_reference_does(zero_results, run):
    """Per-row loss, composer's DecoupledAdamW and an EMA of the weights (0.9) on 2 ranks equal the
    reference's rules written out in one process on whole global batches; the checkpoint holds the
    average whole (ema.pt), which the reader returns."""
    got, expected = zero_results[run]["losses"], zero_results["semantics_reference"]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, expected)) <= 1e-6, (got, expected)
    result = zero_results[run]
    assert result["ema_recorded"] == {"decay": 0.9} and result["ema_keys_match"]
    assert result["ema_diff"] <= 1e-6 < 1e-4 <= result["ema_not_weights"], result


@pytest.mark.multiproc
def test_losses_match_the_megatron_engine(straight, megatron_results):
    """TP=1, PP=1, DP=2 in both engines (megatron with its distributed optimizer): same start,
    same samples and orders, same optimizer and schedule."""
    got = [loss for _, loss in losses(straight)]
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, megatron_results["losses"])) <= 2e-6, (got, megatron_results)


MOE = (
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.moe_intermediate_size=128",
    "model.num_shared_experts=1",
    "model.moe_z_loss_coeff=1e-3",
)


@pytest.mark.multiproc
@pytest.mark.slow
def test_moe_losses_match_the_megatron_engine_at_ep2(tmp_path, data_cache):
    """An MoE model: DeepSpeed's torch body, data-parallel with the router losses added to its
    NLL sum, against megatron's MoE layers at EP = 2 from the same weights and data."""
    run_dir = tmp_path / "moe"
    setdiff(*train_args(run_dir, data_cache, *MOE))
    got = [v for _, v in losses(run_dir)]
    (tmp_path / "m").mkdir()
    expected = megatron_worker(tmp_path / "m" / "megatron.json", data_cache, *MOE, "parallel.ep=2")["losses"]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, expected)) <= 1e-5, (got, expected)


@pytest.mark.slow  # 35 s; the rules have unit tests (tests/training/test_training_semantics.py); the engines' losses match above
@pytest.mark.multiproc
def test_the_references_semantics_mean_the_same_in_both_engines(both_engines_with_the_references_semantics):
    """Per-row loss, DecoupledAdamW and the EMA (validation at the last step runs on it) under
    both engines at DP=2 from the same start: the same losses, and the same validation loss."""
    run_dir, megatron = both_engines_with_the_references_semantics
    got = [loss for _, loss in losses(run_dir)]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, megatron["losses"])) <= 2e-6, (got, megatron)
    assert losses(run_dir, "valid/loss")[-1] == (STEPS, pytest.approx(megatron["valid"], abs=2e-6))


@pytest.mark.multiproc
@pytest.mark.slow  # two runs a family; the megatron engine's families are in the default suite
@pytest.mark.parametrize(
    "family", [("method.family=mdlm",), ("method.family=bd3lm", "method.block_size=4")], ids=["mdlm", "bd3lm"]
)
def test_the_baselines_train_alike_in_both_engines(tmp_path, data_cache, straight, family):
    """MDLM and BD3-LM under DeepSpeed ZeRO-2 (the torch body) and the megatron engine at DP=2 from
    the same start, noise levels and masks: the same losses, and the same validation loss."""
    run_dir = tmp_path / "deepspeed"
    setdiff(*train_args(run_dir, data_cache, *family))
    (tmp_path / "megatron").mkdir()
    megatron = megatron_worker(tmp_path / "megatron" / "family.json", data_cache, *family)
    got = [loss for _, loss in losses(run_dir)]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, megatron["losses"])) <= 2e-6, (got, megatron)
    assert losses(run_dir, "valid/loss")[-1] == (STEPS, pytest.approx(megatron["valid"], abs=2e-6))


@pytest.mark.multiproc
def test_megatron_decoupled_adamw_steps_are_composers(megatron_results):
    """train.optimizer=decoupled_adamw under megatron's distributed optimizer at DP=2: every
    parameter decayed by (lr_t / lr) x weight_decay, then Adam (the single-process check of the same
    rule: tests/training/test_training_semantics.py)."""
    assert megatron_results["decoupled_worst"] <= 1e-7


@pytest.mark.multiproc
@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_lr_schedule_equals_the_megatron_engines(megatron_results, schedule):
    recipe = load_recipe(
        RECIPE, [f"train.schedule={schedule}", "train.warmup_steps=10", "train.min_lr=1e-4", "train.decay_fraction=0.3"]
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(recipe, optimizer, SCHEDULE_STEPS)
    lrs = []
    for _ in range(SCHEDULE_STEPS):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    assert lrs == megatron_results["schedules"][schedule]


@pytest.mark.multiproc
@pytest.mark.slow
def test_resume_after_sigterm_is_exact(tmp_path, data_cache, straight):
    """SIGTERM to the whole job after step 2: a checkpoint at the next step boundary, exit 75;
    the relaunch resumes there and logs the uninterrupted run's losses exactly."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        cli(*train_args(run_dir, data_cache)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        metrics, deadline = run_dir / "logs" / "metrics.jsonl", time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if "train/loss" in line) >= 2:
                os.killpg(proc.pid, signal.SIGTERM)
                break
            time.sleep(0.1)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = losses(run_dir)[-1][0]
    checkpoint = run_dir / "checkpoints" / f"step_{stopped:08d}"
    assert proc.returncode == EXIT_REQUEUE and stopped < STEPS, output[-3000:]
    assert f"stopped at step {stopped} by SIGTERM; checkpoint {checkpoint}" in output
    assert verify(checkpoint) is None

    resumed = setdiff(*train_args(run_dir, data_cache), check=False)
    assert resumed.returncode == 0 and f"resumed from {checkpoint} at step {stopped}" in resumed.stdout, resumed.stderr[
        -3000:
    ]
    assert losses(run_dir)[stopped:] == losses(straight)[stopped:]


@pytest.mark.multiproc
@pytest.mark.slow
def test_init_from_a_checkpoint_starts_from_its_weights(tmp_path, data_cache, straight):
    """model.init_from, read through sources/read.py and consolidated_state_dict: the new run's
    validation loss before its first step is the source run's after its last."""
    source = straight / "checkpoints" / f"step_{STEPS:08d}"
    out = setdiff(*train_args(tmp_path / "run", data_cache, f"model.init_from={source}", "train.steps=1"), check=False)
    assert out.returncode == 0 and f"initialised from DeepSpeed checkpoint {source}" in out.stdout, out.stderr[-3000:]
    assert losses(tmp_path / "run", "valid/loss")[0] == (0, losses(straight, "valid/loss")[-1][1])


@pytest.mark.multiproc
@pytest.mark.slow
def test_tiny_recipe_lowers_the_validation_loss(tmp_path, data_cache):
    """`setdiff train recipes/tiny-cpu-deepspeed.yaml`, shortened to 40 steps."""
    run_dir = tmp_path / "run"
    overrides = ["log.tensorboard=false", "train.steps=40", "eval.interval=40", "checkpoint.interval=40"]
    setdiff("train", RECIPE, f"checkpoint.dir={run_dir}", f"data.cache_dir={data_cache}", *overrides, timeout=1800)
    valid = [loss for _, loss in losses(run_dir, "valid/loss")]
    assert len(valid) == 2 and valid[1] < valid[0] - 1.0, valid
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000040"


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_loss_follows_the_recipe_policy(tmp_path, data_cache, policy):
    """An absurd learning rate without clipping sends the weights to inf within a step or two;
    ZeRO's optimizer then skips the update of non-finite gradients."""
    out = setdiff(
        *train_args(
            tmp_path / "run",
            data_cache,
            "launch.nproc_per_node=1",
            "parallel.global_batch_size=8",
            "train.warmup_steps=0",
            "train.lr=1e30",
            "train.clip_grad=0",
            "train.schedule=constant",
            "train.min_lr=1e30",
            f"train.nan_policy={policy}",
        ),
        check=False,
    )
    if policy == "stop":
        assert out.returncode == 2 and "train.nan_policy=stop" in out.stderr and "Traceback" not in out.stderr, (
            out.stderr[-2000:]
        )
    else:
        assert out.returncode == 0, out.stderr[-2000:]
        assert "step skipped (train.nan_policy=skip)" in out.stdout + out.stderr


@pytest.mark.multiproc
@pytest.mark.slow
def test_compiled_model_trains_as_the_eager_one(tmp_path, data_cache, straight):
    """train.compile: torch.compile changes how the step runs, not what it computes. One compiled
    process (one compile: the costly part on a CPU) against the two-process eager run: the losses
    agree across layouts too."""
    setdiff(*train_args(tmp_path / "run", data_cache, "train.compile=true", "launch.nproc_per_node=1"), timeout=1200)
    compiled, eager = losses(tmp_path / "run"), losses(straight)
    assert [s for s, _ in compiled] == [s for s, _ in eager]
    assert max(abs(a - b) for (_, a), (_, b) in zip(compiled, eager)) < 1e-5
