"""Checkpoints of real runs: preemption signals, exact resume, resharding, broken checkpoints.

Every run is `setdiff train recipes/tiny-cpu.yaml` with overrides, as a user starts it, so every
test is marked multiproc; those with three launches of a minute or more on two cores are also
marked slow.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from setdiff_megatron.checkpoint.manifest import verify
from setdiff_megatron.distributed.signals import EXIT_REQUEUE
from tests.checkpoint.test_run_directory import flip_a_byte, truncate
from tests.cli_runs import cli, setdiff
from tests.training.leftovers import left_behind

pytestmark = pytest.mark.multiproc

TINY = str(Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml")
# Small global batches, a loss logged at every step, no validation.
BASE = ("log.tensorboard=false", "parallel.global_batch_size=8", "log.interval=1", "eval.interval=1000")


def train_args(run_dir: Path, data_cache: Path, *overrides: str) -> list[str]:
    """`setdiff train` of the recipe into `run_dir`, BASE and `overrides` over it."""
    return ["train", TINY, f"checkpoint.dir={run_dir}", f"data.cache_dir={data_cache}", *BASE, *overrides]


def command(run_dir: Path, data_cache: Path, *overrides: str) -> list[str]:
    """The command line of `train_args`, for a run started with Popen."""
    return cli(*train_args(run_dir, data_cache, *overrides))


def run_train(run_dir: Path, data_cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    return setdiff(*train_args(run_dir, data_cache, *overrides), check=False)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, train loss) in the order logged, across every launch of the run."""
    text = (run_dir / "logs" / "metrics.jsonl").read_text()
    lines = text.splitlines()[: None if text.endswith("\n") else -1]  # a line being written is left out
    return [(m["step"], m["train/loss"]) for m in map(json.loads, lines) if "train/loss" in m]


def signalled(
    run_dir: Path, data_cache: Path, *overrides: str, after_step: int, send: list, group: bool = False
) -> tuple[subprocess.CompletedProcess, list]:
    """Start a run, wait until it logged `after_step`, then send each (signal, delay) of `send`
    to it, or with `group` to its whole process group as a scheduler does. Returns the finished
    process (stdout and stderr together) and the losses this launch logged, once checked to have
    left no process of its session running (checkpoint writers and their managers included)."""
    metrics = run_dir / "logs" / "metrics.jsonl"
    logged_before = len(losses(run_dir)) if metrics.is_file() else 0
    out_path = run_dir.parent / f"{run_dir.name}.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            command(run_dir, data_cache, *overrides), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                new = losses(run_dir)[logged_before:] if metrics.is_file() else []
                if new and new[-1][0] >= after_step:
                    break
                time.sleep(0.1)
            for sig, delay in send:
                time.sleep(delay)
                if proc.poll() is not None:
                    break
                if group:
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
            proc.wait(timeout=600)
            leftover = left_behind(proc.pid)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert not leftover, leftover
    return (
        subprocess.CompletedProcess(proc.args, proc.returncode, out_path.read_text(), ""),
        losses(run_dir)[logged_before:],
    )


def checkpoint_of(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def test_sigterm_and_sigusr1_checkpoint_exit_75_and_the_run_resumes(tmp_path, data_cache):
    run, args = tmp_path / "run", ("launch.nproc_per_node=1", "train.steps=40", "checkpoint.interval=100")
    # The second SIGTERM arrives while the first one's checkpoint is being written.
    first, logged = signalled(run, data_cache, *args, after_step=2, send=[(signal.SIGTERM, 0.0), (signal.SIGTERM, 0.5)])
    stopped = logged[-1][0]
    assert first.returncode == EXIT_REQUEUE, first.stdout[-3000:]
    assert f"stopped at step {stopped} by SIGTERM; checkpoint {checkpoint_of(run, stopped)}" in first.stdout
    assert verify(checkpoint_of(run, stopped)) is None
    assert (run / "checkpoints" / "latest").read_text().strip() == checkpoint_of(run, stopped).name

    second, resumed = signalled(run, data_cache, *args, after_step=stopped + 1, send=[(signal.SIGUSR1, 0.0)])
    assert second.returncode == EXIT_REQUEUE, second.stdout[-3000:]
    assert f"resumed from {checkpoint_of(run, stopped)} at step {stopped}" in second.stdout
    assert resumed[0][0] == stopped + 1 and f"stopped at step {resumed[-1][0]} by SIGUSR1" in second.stdout
    assert verify(checkpoint_of(run, resumed[-1][0])) is None


@pytest.mark.slow  # 38 s; test_checkpoint_safety.py skips each kind of damage
def test_broken_or_foreign_checkpoints_are_named_and_skipped(tmp_path, data_cache):
    run, args = (
        tmp_path / "run",
        ("launch.nproc_per_node=1", "train.steps=4", "checkpoint.interval=1", "checkpoint.keep_last_n=4"),
    )
    assert run_train(run, data_cache, *args).returncode == 0
    expected = losses(run)
    other = tmp_path / "other"
    out = run_train(other, data_cache, "launch.nproc_per_node=1", "train.steps=1", "model.hidden_size=64")
    assert out.returncode == 0, out.stderr[-3000:]
    foreign = checkpoint_of(run, 9)
    shutil.copytree(checkpoint_of(other, 1), foreign)  # a smaller model's checkpoint, the newest here
    truncate(checkpoint_of(run, 4) / "__0_0.distcp")
    flip_a_byte(checkpoint_of(run, 3) / "__0_1.distcp")

    out = run_train(run, data_cache, *args, f"checkpoint.resume={foreign}")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = [line for line in out.stderr.splitlines() if line.startswith("setdiff: error:")]
    assert line.startswith(f"setdiff: error: checkpoint.resume: cannot load {foreign}: ")
    assert f"{foreign / 'train_state.json'} is for another model: hidden_size 64 there, 128 here" in line

    out = run_train(run, data_cache, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    skipped = [line for line in out.stdout.splitlines() if line.startswith("setdiff: skipping")]
    assert len(skipped) == 3
    assert f"{foreign / 'train_state.json'} is for another model" in skipped[0]
    assert f"{checkpoint_of(run, 4) / '__0_0.distcp'} has " in skipped[1]
    assert f"{checkpoint_of(run, 3) / '__0_1.distcp'} does not match its sha256" in skipped[2]
    assert f"resumed from {checkpoint_of(run, 2)} at step 2" in out.stdout
    assert losses(run)[len(expected) :] == expected[2:]  # steps 3 and 4 again, exactly


@pytest.mark.slow  # 28 s; exit 75 and the resume run by default in the test above and in tests/launch
def test_two_processes_preempted_through_the_launcher_exit_75(tmp_path, data_cache):
    """A scheduler signals every process of the job: the `setdiff train` launcher, torchrun, the
    workers and their checkpoint helpers; a second signal follows during the save."""
    run = tmp_path / "run"
    result, logged = signalled(
        run,
        data_cache,
        "parallel.tp=2",
        "train.steps=40",
        "checkpoint.interval=100",
        after_step=2,
        send=[(signal.SIGTERM, 0.0), (signal.SIGUSR1, 1.0)],
        group=True,
    )
    stopped = logged[-1][0]
    assert result.returncode == EXIT_REQUEUE, result.stdout[-3000:]
    assert f"stopped at step {stopped} by SIGTERM" in result.stdout
    assert verify(checkpoint_of(run, stopped)) is None


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2"])
def test_two_process_resume_is_bitwise_and_reshards_to_one_process(tmp_path, data_cache, layout):
    args = ("train.steps=6", "checkpoint.interval=3", layout)
    straight = tmp_path / "straight"
    out = run_train(straight, data_cache, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = losses(straight)
    assert [s for s, _ in expected] == [1, 2, 3, 4, 5, 6]

    # New processes, same layout, from the step-3 checkpoint: identical losses, bit for bit.
    resumed = tmp_path / "resumed"
    shutil.copytree(checkpoint_of(straight, 3), checkpoint_of(resumed, 3))
    out = run_train(resumed, data_cache, *args)
    assert out.returncode == 0 and f"resumed from {checkpoint_of(resumed, 3)}" in out.stdout, out.stderr[-3000:]
    assert losses(resumed) == expected[3:]

    # One process, TP=1 PP=1 CP=1: weights and optimizer state reshard through dist_checkpointing.
    single = tmp_path / "single"
    shutil.copytree(checkpoint_of(straight, 3), checkpoint_of(single, 3))
    out = run_train(
        single, data_cache, *args, "launch.nproc_per_node=1", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1"
    )
    assert out.returncode == 0 and "saved at tp " in out.stdout, out.stderr[-3000:]
    got = losses(single)
    assert [s for s, _ in got] == [4, 5, 6] and got[0][1] == pytest.approx(expected[3][1], abs=1e-5)
    assert [v for _, v in got] == pytest.approx([v for _, v in expected[3:]], abs=1e-4)
