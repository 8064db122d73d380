"""`setdiff launch RECIPE --slurm` on a real cluster: training through srun, preemption, two
nodes, and sampling from the result as a job array.

A short tiny-cpu run (20 steps, 2 tasks) is the reference; a second one gets SIGUSR1 in its
batch shell mid-run, must checkpoint, exit 75, requeue itself and resume to the same losses; a
third saves in the background (checkpoint.async_save) every 3 steps and gets SIGTERM in its
training tasks, as a preemption sends it: the same, with a save likely still writing.
Both share one data cache, so only the first builds the tokenizer and indices. The reference
checkpoint is then sampled by a 2-shard array and a merge job, and locally.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from setdiff_megatron.launch.slurm import submit_sharded
from tests.cli_runs import cli, setdiff
from tests.launch.slurm_cluster import require_two_nodes
from tests.launch.slurm_jobs import (
    REPO,
    TINY,
    cancel,
    finished,
    isolated_env,
    job,
    losses,
    wait_for_file_line,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

STEPS = 20


def submit(run_dir: Path, cache: Path, env: dict[str, str], *overrides: str) -> tuple[str, Path]:
    out = setdiff(
        "launch",
        str(TINY),
        "--slurm",
        f"train.steps={STEPS}",
        "checkpoint.interval=10",
        "eval.interval=10",
        "log.interval=1",
        f"checkpoint.dir={run_dir}",
        f"data.cache_dir={cache}",
        *overrides,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)
    log = Path(re.search(r"^log: (\S+)", out.stdout, re.M).group(1))
    assert log == run_dir / "slurm" / f"tiny-cpu-{job_id}.out"
    return job_id, log


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-train")
    return root / "cache", isolated_env(tmp_path_factory.mktemp("config"))


@pytest.fixture(scope="module")
def reference(shared, tmp_path_factory):
    """An uninterrupted run: (job id, run dir, log)."""
    cache, env = shared
    run_dir = tmp_path_factory.mktemp("reference")
    job_id, log = submit(run_dir, cache, env)
    try:
        state = wait_until(job_id, finished, timeout=420, what="finished", log=log)
    finally:
        cancel(job_id)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log.read_text(errors="replace")[-3000:]
    return job_id, run_dir, log


def test_launch_slurm_trains_two_ranks_through_srun(reference):
    job_id, run_dir, log = reference
    text = log.read_text(errors="replace")
    assert (run_dir / "slurm" / "train.sbatch").is_file()
    assert f"setdiff: job {job_id} (restart 0)" in text
    assert "0: rank 0 of 2" in text and "1: rank 1 of 2" in text  # srun --label: both tasks ran
    assert f"done: {STEPS} steps" in text
    assert f"checkpoint: {run_dir}/checkpoints/step_{STEPS:08d}" in text
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert (STEPS, "train/loss") in losses(run_dir)


@pytest.mark.parametrize(
    "signal,overrides",
    [
        pytest.param("USR1", (), id="usr1-batch-shell", marks=pytest.mark.slow),  # 50 s; the requeue path is shared
        pytest.param(
            "TERM",
            ("checkpoint.async_save=true", "checkpoint.interval=3"),
            id="sigterm-async-saves",
            marks=pytest.mark.slow,  # 38 s (2026-12-06); the default suite keeps the srun job
        ),
    ],
)
def test_a_signal_checkpoints_requeues_and_resumes_to_the_same_losses(shared, reference, tmp_path, signal, overrides):
    cache, env = shared
    run_dir = tmp_path / "preempted"
    job_id, log = submit(run_dir, cache, env, *overrides)
    try:
        # Step 5 logged: training is under way. USR1 goes to the batch shell only, as the
        # scheduler's --signal=B:USR1@lead does before a time limit; TERM to the training tasks, as
        # a preemption sends it.
        wait_for_file_line(
            run_dir / "logs" / "metrics.jsonl", lambda line: '"step": 5,' in line, timeout=300, job_id=job_id
        )
        assert job(job_id)["JobState"] == "RUNNING"
        where = ["--batch"] if signal == "USR1" else []
        subprocess.run(["scancel", f"--signal={signal}", *where, job_id], check=True, timeout=30)
        state = wait_until(
            job_id,
            lambda s: s.get("Restarts") == "1" and s.get("JobState") == "PENDING",
            timeout=180,
            what="requeued",
            log=log,
        )
        text = log.read_text(errors="replace")
        stopped = int(re.search(rf"stopped at step (\d+) by SIG{signal}", text).group(1))
        assert 5 <= stopped < STEPS
        assert "exit 75); requeueing job" in text
        assert (run_dir / "checkpoints" / f"step_{stopped:08d}").is_dir()
        # A requeued job waits for its BeginTime (about 2 minutes); release it now. Not within the
        # second it ended, though: slurmd refuses to start it on a credential that old ("Job
        # credential revoked") and the job fails.
        time.sleep(5)
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True, timeout=30)
        state = wait_until(job_id, finished, timeout=420, what="finished", log=log)
    finally:
        cancel(job_id)
    text = log.read_text(errors="replace")
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), text[-3000:]
    assert f"setdiff: job {job_id} (restart 1)" in text
    assert f"resumed from {run_dir}/checkpoints/step_{stopped:08d} at step {stopped}" in text
    assert losses(run_dir) == losses(reference[1])  # every train and validation loss, exactly


def completed(run_dir: Path, cache: Path, env: dict[str, str], *overrides: str) -> tuple[dict[str, str], str]:
    """Submit a training job, wait for it, and check it completed: its final state and log."""
    job_id, log = submit(run_dir, cache, env, *overrides)
    try:
        state = wait_until(job_id, finished, timeout=420, what="finished", log=log)
    finally:
        cancel(job_id)
    text = log.read_text(errors="replace")
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    return state, text


@pytest.mark.slow  # 39 s (2026-12-06)
def test_two_nodes_train_as_one_and_their_checkpoint_resumes_on_one_node(shared, reference, tmp_path):
    """launch.nnodes=2 on partition `multi` (tools/local_slurm.sh: two slurmds, each in its own
    network namespace with its own address and hostname), one process per node under torchrun,
    c10d rendezvous on the first node: the reference's global batch over the same 2 ranks, so its
    losses, bit for bit. The checkpoint of step 10 written across the nodes then resumes in a
    one-node job (2 processes) to the reference's losses."""
    require_two_nodes()
    cache, env = shared
    two = tmp_path / "two"
    state, text = completed(
        two,
        cache,
        env,
        "launch.nnodes=2",
        "launch.nproc_per_node=1",
        "launch.slurm.launcher=torchrun",
        "launch.slurm.partition=multi",
    )
    assert state["NodeList"] == "sdnode[1-2]" and "rendezvous sdnode1:" in text
    assert any(line.startswith("1: ") for line in text.splitlines())  # srun --label: the second node's torchrun
    assert losses(two) == losses(reference[1])

    step10 = two / "checkpoints" / "step_00000010"
    one = tmp_path / "one"
    state, text = completed(one, cache, env, f"checkpoint.resume={step10}")
    assert "sdnode" not in state["NodeList"] and f"resumed from {step10} at step 10" in text
    resumed, expected = losses(one), losses(reference[1])
    assert min(step for step, _ in resumed) == 11 and resumed == {k: expected[k] for k in resumed}


@pytest.mark.slow
def test_a_node_lost_mid_run_requeues_and_resumes_to_the_same_losses(shared, reference, tmp_path):
    """The two-node job of the test above, with torchrun allowed a restart: at step 12 every process
    of sdnode2 is SIGKILLed, its slurmd included (a node gone). The first node's torchrun waits to
    re-rendezvous; slurmctld marks the node down (SlurmdTimeout, up to about 45 s), fails the job
    over to a requeue (#SBATCH --requeue); the node comes back (its slurmd restarted, as after a
    reboot) and the requeued job resumes from step 10 to the reference's losses."""
    require_two_nodes()
    cache, env = shared
    run_dir = tmp_path / "lost"
    job_id, log = submit(
        run_dir,
        cache,
        env,
        "launch.nnodes=2",
        "launch.nproc_per_node=1",
        "launch.slurm.launcher=torchrun",
        "launch.slurm.partition=multi",
        "launch.max_restarts=1",
    )
    try:
        wait_for_file_line(
            run_dir / "logs" / "metrics.jsonl", lambda line: '"step": 12,' in line, timeout=300, job_id=job_id
        )
        pids = subprocess.run(["ip", "netns", "pids", "sdnode2"], capture_output=True, text=True, timeout=30).stdout
        for pid in map(int, pids.split()):
            os.kill(pid, signal.SIGKILL)
        wait_until(
            job_id,
            lambda s: s.get("Restarts") == "1" and s.get("JobState") == "PENDING",
            timeout=240,
            what="requeued after the node failure",
            log=log,
        )
        back = subprocess.run(
            [str(REPO / "tools" / "local_slurm.sh"), "start"], capture_output=True, text=True, timeout=120
        )
        assert back.returncode == 0, back.stdout + back.stderr
        time.sleep(5)  # see the preemption test: a credential from the second the job ended is refused
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True, timeout=30)
        state = wait_until(job_id, finished, timeout=420, what="finished", log=log)
    finally:
        cancel(job_id)
        subprocess.run([str(REPO / "tools" / "local_slurm.sh"), "start"], capture_output=True, timeout=120)
    text = log.read_text(errors="replace")
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), text[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_00000010 at step 10" in text
    assert losses(run_dir) == losses(reference[1])


@pytest.mark.slow  # 16 s; tests/launch/test_slurm_array_jobs.py runs the array by default
def test_sample_array_of_two_shards_then_merge_equals_a_local_run(reference, shared, tmp_path):
    """`setdiff sample` on the reference checkpoint: 2 array shards (--shard {shard} --num-shards
    {num_shards}) and the same command without them as the afterok merge job, against one local run."""
    _, run_dir, _ = reference
    _, env = shared
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": text}) + "\n"
            for i, text in enumerate(["def f(x):\n", "import os\n", "class A:\n", "for i in range(3):\n", "x = "])
        )
    )
    options = ["--prompts", str(prompts), "--batch-size", "2", "--max-new-tokens", "8", "--no-progress"]
    local = setdiff("sample", str(run_dir), *options, "--out", str(tmp_path / "local.jsonl"), env=env, timeout=300)
    assert local.returncode == 0, local.stderr

    base = cli("sample", run_dir, *options, "--out", tmp_path / "out.jsonl")
    jobs = submit_sharded(
        [*base, "--shard", "{shard}", "--num-shards", "{num_shards}"],
        base,
        num_shards=2,
        work_dir=tmp_path,
        job_name="sample",
    )
    try:
        merge = wait_until(
            jobs.merge_id,
            finished,
            timeout=300,
            what="finished",
            log=tmp_path / "slurm" / f"sample-merge-{jobs.merge_id}.out",
        )
        shards = [job(f"{jobs.array_id}_{i}") for i in range(2)]
    finally:
        cancel(jobs.array_id)
        cancel(jobs.merge_id)
    assert [s["JobState"] for s in shards] == ["COMPLETED", "COMPLETED"]
    assert (merge["JobState"], merge["ExitCode"]) == ("COMPLETED", "0:0")

    def results(path: Path) -> list[dict]:  # all but the wall-clock time
        return [
            {k: v for k, v in json.loads(line).items() if k not in ("seconds", "busy_seconds")}
            for line in path.read_text().splitlines()
        ]

    assert len(results(tmp_path / "out.jsonl")) == 5
    assert results(tmp_path / "out.jsonl") == results(tmp_path / "local.jsonl")


@pytest.mark.slow
def test_an_eight_rank_layout_over_two_nodes_equals_it_on_one_node(shared, tmp_path):
    """TP2 x PP2 x DP2 as 2 nodes x 4 processes (partition `multi`, torchrun on each node, the
    tensor- and pipeline-parallel groups across the nodes' network namespaces) against the same
    layout in 8 processes of the local launcher: the same losses, step for step."""
    require_two_nodes()
    cache, env = shared
    # 8 steps, not the 20 of the other jobs here: parity shows from the first step, and 8 ranks are slow on 2 cores
    layout = ("parallel.tp=2", "parallel.pp=2", "parallel.micro_batch_size=4", "train.steps=8")
    two = tmp_path / "two"
    state, _ = completed(
        two,
        cache,
        env,
        "launch.nnodes=2",
        "launch.nproc_per_node=4",
        "launch.slurm.launcher=torchrun",
        "launch.slurm.partition=multi",
        *layout,
    )
    assert state["NodeList"] == "sdnode[1-2]"
    one = tmp_path / "one"
    out = setdiff(
        "train",
        str(TINY),
        "checkpoint.interval=10",
        "eval.interval=10",
        "log.interval=1",
        f"checkpoint.dir={one}",
        f"data.cache_dir={cache}",
        "launch.nproc_per_node=8",
        *layout,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    expected = losses(one)
    assert len(expected) > 8 and losses(two) == pytest.approx(expected, abs=1e-5)
