"""Real runs that meet the faults of large jobs (distributed/fault_injection.py drills them):
slow and hung checkpoint saves, a rank killed during a save and a rank hung mid-run under
torchrun restarts, a straggler, loss spikes under each spike policy. Every run is `setdiff train
recipes/tiny-cpu.yaml` with overrides, in a session of its own, which it must leave with no
process running; the dead and hung ranks' run must end where the uninterrupted one
(`trained_launch`) did.
"""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from setdiff_megatron.checkpoint.manifest import verify
from setdiff_megatron.distributed.fault_injection import INJECT_ENV
from setdiff_megatron.distributed.workers import RESTART_ENV, Torchrun
from tests.cli_runs import setdiff
from tests.training.leftovers import left_behind
from tests.training.test_checkpoint_runs import BASE, TINY, command, losses, train_args

pytestmark = pytest.mark.multiproc


def run_in_session(argv: list[str], env: dict, out: Path) -> subprocess.CompletedProcess:
    """`argv` run to its end as the leader of a new session (stdout and stderr together in `out`),
    checked to leave no process of that session running."""
    with out.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        code = proc.wait(timeout=600)
    text = out.read_text()
    assert not left_behind(proc.pid), text[-3000:]
    return subprocess.CompletedProcess(argv, code, text, "")


def snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every file's inode, modification time and sha256: what an overwrite would change."""
    return {
        str(p.relative_to(directory)): (
            p.stat().st_ino,
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow  # 33 s; the save timeout and the restart exit have unit tests (test_fault_tolerance_units.py)
def test_a_hung_save_is_named_and_restarts_from_the_newest_complete_checkpoint(data_cache, tmp_path):
    """One process under torchrun with a restart (what `setdiff launch --dry-run` prints): the save
    of step 4 hangs, the watchdog names it after the save timeout and exits 76, and the restarted
    process resumes from step 2, the newest complete checkpoint, and finishes, steps 3 and 4 again
    with the losses they had the first time. (A save slower than a step, within its own timeout,
    goes on: the slow test below, and the watchdog's unit tests.)"""
    run = tmp_path / "run"
    overrides = [
        f"checkpoint.dir={run}",
        f"data.cache_dir={data_cache}",
        *BASE,
        "launch.nproc_per_node=1",
        "train.steps=6",
        "checkpoint.interval=2",
        "checkpoint.keep_last_n=10",
        "train.hang_timeout_s=4",
        "train.save_timeout_s=12",  # a real save of this model takes up to 10 s on loaded cores
        "train.startup_timeout_s=120",  # imports, data and model on loaded cores
    ]
    env = {**os.environ, **RESTART_ENV, INJECT_ENV: "hang:step=4:seconds=600:at=save"}
    out = run_in_session(Torchrun(1, ["train", TINY, *overrides], max_restarts=1).argv, env, tmp_path / "out.txt")
    assert out.returncode == 0, out.stdout[-3000:]
    [hung] = [line for line in out.stdout.splitlines() if "no progress for" in line]
    assert "in the checkpoint save of step 4 (train.save_timeout_s = 12)" in hung and "exiting with code 76" in hung
    assert "in_save" in (run / "logs" / "hang-rank0.txt").read_text()
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in out.stdout
    assert [verify(run / "checkpoints" / f"step_{s:08d}") for s in (2, 4, 6)] == [None] * 3
    steps, replayed = [s for s, _ in losses(run)], [loss for s, loss in losses(run) if s in (3, 4)]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6] and replayed[:2] == replayed[2:]


@pytest.mark.slow  # 33 s; a rank killed in a save restarts in job in the slow test below too
def test_a_killed_rank_restarts_in_job_and_ends_like_the_uninterrupted_run(data_cache, tmp_path):
    """One process under torchrun with a restart: SIGKILLed at the start of step 3, it is restarted
    by torchrun (launch.max_restarts = 1), resumes from step 2's checkpoint, and replays step 3
    with the loss it would have had; the run ends at step 4, nothing left running."""
    run = tmp_path / "run"
    overrides = [
        f"checkpoint.dir={run}",
        f"data.cache_dir={data_cache}",
        *BASE,
        "launch.nproc_per_node=1",
        "train.steps=4",
        "checkpoint.interval=2",
        "train.startup_timeout_s=120",
    ]
    env = {**os.environ, **RESTART_ENV, INJECT_ENV: "kill:step=3"}
    out = run_in_session(Torchrun(1, ["train", TINY, *overrides], max_restarts=1).argv, env, tmp_path / "out.txt")
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in out.stdout
    steps = [s for s, _ in losses(run)]
    assert steps == [1, 2, 3, 4]  # step 3 was killed before its loss was logged, then run again
    uninterrupted = tmp_path / "whole"
    rest = [o for o in overrides if not o.startswith(("checkpoint.dir=", "data.cache_dir="))]
    setdiff(*train_args(uninterrupted, data_cache, *rest), timeout=600)
    assert losses(run) == losses(uninterrupted)


@pytest.mark.slow  # 77 to 110 s beside a CPU-bound process; the watchdog's phases, the drills and the cleanup have unit tests
def test_a_slow_save_a_rank_killed_in_a_save_and_a_hung_rank_end_like_the_uninterrupted_run(
    trained_launch, data_cache, tmp_path
):
    """trained_launch's run (TP=2, 20 steps) with checkpoints every 5 steps, beside a CPU-bound
    process (cores shared with other work): rank 0's save of step 5 sleeps past the step timeout
    and completes; rank 1 is SIGKILLed inside the save of step 10, and in the restarted attempt it
    hangs at step 12. torchrun restarts the job twice; it ends with the uninterrupted run's final
    loss, bit for bit, the checkpoint of step 5 that the first restart resumed from is never
    rewritten, and no process of the run is left."""
    baseline = dict(losses(trained_launch[0]))[20]
    run = tmp_path / "run"
    argv = command(
        run,
        data_cache,
        "parallel.tp=2",
        "train.steps=20",
        "checkpoint.interval=5",
        "checkpoint.keep_last_n=10",
        "launch.max_restarts=2",
        "train.hang_timeout_s=5",
        "train.save_timeout_s=60",  # a real save takes up to 11 s beside the busy process
        "train.startup_timeout_s=120",  # imports, data, model and resume beside the busy process
    )
    env = {
        **os.environ,
        INJECT_ENV: "hang:rank=0:step=5:seconds=7:at=save,kill:rank=1:step=10:at=save,"
        "hang:rank=1:step=12:seconds=600:attempt=1",
    }
    step5 = run / "checkpoints" / "step_00000005"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with (tmp_path / "out.txt").open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            deadline = time.monotonic() + 600
            while not (step5 / "manifest.json").is_file() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            before = snapshot(step5)
            code = proc.wait(timeout=600)
    finally:
        busy.kill()
    text = (tmp_path / "out.txt").read_text()
    assert code == 0, text[-3000:]
    assert not left_behind(proc.pid), text[-3000:]
    assert "killing rank 1 in the checkpoint save of step 10" in text and f"resumed from {step5} at step 5" in text
    # Rank 0 waits for rank 1 in the step's collectives: its watchdog may fire too. None fired in the slow save.
    hung = [line for line in text.splitlines() if "no progress for" in line]
    assert hung and all("in step 12 (train.hang_timeout_s = 5)" in line for line in hung), hung
    assert any(line.startswith("setdiff: rank 1: no progress for") for line in hung), hung
    assert "exiting with code 76" in hung[0] and "at_step_start" in (run / "logs" / "hang-rank1.txt").read_text()
    assert f"resumed from {run / 'checkpoints' / 'step_00000010'} at step 10" in text
    logged = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["checkpoint/blocked_s"] > 7 for m in logged if m.get("checkpoint/step") == 5] == [True]
    assert before and snapshot(step5) == before
    assert [verify(run / "checkpoints" / f"step_{s:08d}") for s in (5, 10, 15, 20)] == [None] * 4
    assert dict(losses(run))[20] == baseline


@pytest.mark.slow  # 24 s; the straggler and spike rules have unit tests
def test_a_straggler_is_named_and_a_spike_skipped(data_cache, tmp_path):
    """Two data-parallel ranks, rank 1 a second slower per step (named while the other rank's
    compute stays under 2 s per step, also on a loaded machine): the metrics carry every rank's
    compute time and the log names rank 1. A loss spike at step 6 skips that update."""
    run = tmp_path / "run"
    env = {**os.environ, INJECT_ENV: "slow:rank=1:seconds=1.0,spike:step=6:factor=50"}
    out = run_in_session(
        command(
            run,
            data_cache,
            "parallel.micro_batch_size=4",
            "train.steps=8",
            "log.interval=4",
            "checkpoint.interval=8",
            "train.spike_policy.action=skip",
            "train.spike_policy.window=8",
            "train.spike_policy.min_history=4",
        ),
        env,
        tmp_path / "out.txt",
    )
    assert out.returncode == 0, out.stdout[-3000:]
    text = out.stdout
    assert "step 4: rank 1 is a straggler" in text and "train.straggler_factor = 1.5" in text
    assert "step 6: loss" in text and "update skipped" in text
    logged = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    ranks = [m for m in logged if "ranks/compute_s" in m]
    assert [m["step"] for m in ranks] == [4, 8] and all(m["ranks/slowest"] == 1 for m in ranks)
    assert all(m["ranks/compute_s"][1] > m["ranks/compute_s"][0] + 0.8 for m in ranks)


def test_a_spike_rolls_back_past_its_batch_and_a_recurring_one_stops_the_run(data_cache, tmp_path):
    """One process. A one-off spike at step 6 rolls back to step 4 and replays steps 5 and 6 on
    the batches after the bad one; a spike at step 10 that comes back after its rollback to step
    8 (a deterministic one) stops the run with one line."""
    run = tmp_path / "run"
    env = {**os.environ, INJECT_ENV: "spike:step=6:factor=50,spike:step=10:factor=50:always"}
    out = run_in_session(
        command(
            run,
            data_cache,
            "launch.nproc_per_node=1",
            "train.steps=12",
            "checkpoint.interval=4",
            "checkpoint.keep_last_n=10",
            "checkpoint.async_save=false",
            "train.spike_policy.action=rollback",
            "train.spike_policy.window=8",
            "train.spike_policy.min_history=3",
        ),
        env,
        tmp_path / "out.txt",
    )
    assert out.returncode == 2, out.stdout[-3000:]
    assert "rolled back to the checkpoint of step 4, its data order moved past the batches up to step 6" in out.stdout
    assert "rolled back to the checkpoint of step 8" in out.stdout
    error = [line for line in out.stdout.splitlines() if line.startswith("setdiff: error:")]
    assert len(error) == 1 and "a spike again at step 10 after rolling back for the one at step 10" in error[0]
    logged = losses(run)
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9]  # no spiked step is logged
    for replayed in ([loss for s, loss in logged if s == 5], [loss for s, loss in logged if s == 9]):
        assert replayed[0] != replayed[1]  # the same step on other data
