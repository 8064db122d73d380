"""Submitting to SLURM: a recipe becomes a training job; a sharded command becomes a job array
plus a merge job that starts when every shard succeeded.

`launch_slurm` is `setdiff launch RECIPE --slurm`: it resolves the recipe's launch section over
the cluster file (cluster.py), checks the request against the cluster, renders the script
(sbatch.py), writes it to <checkpoint.dir>/slurm/train.sbatch and submits it with
`sbatch --parsable`; with `dry_run` it prints the script instead. `submit_sharded` runs any
command over N shards ({shard}, {num_shards} placeholders) and then a merge command, e.g.
`setdiff sample ... --shard {shard} --num-shards {num_shards}` and the same without the flags.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from setdiff_megatron.errors import UserError
from setdiff_megatron.launch.cluster import ClusterFile, load_cluster_file
from setdiff_megatron.launch.sbatch import (
    CPU_ENV,
    GPU_ENV,
    Resources,
    recipe_lines,
    render_array,
    render_command,
    render_train,
)
from setdiff_megatron.recipes import Recipe, load_recipe
from setdiff_megatron.recipes.schema import SlurmSection

__all__ = ["launch_slurm", "submit_sharded"]

DEFAULT_TIME = "01:00:00"


@dataclass
class Planned:
    """A rendered job: its script, where it goes, and its output file pattern."""

    text: str
    path: Path
    output: str
    gpus_per_node: int = 0


@dataclass
class ShardedJobs:
    array: Planned
    merge: Planned
    array_id: str | None = None
    merge_id: str | None = None


def sbatch_executable() -> str:
    exe = shutil.which("sbatch")
    if exe is None:
        raise UserError(
            "sbatch not found: this machine cannot submit SLURM jobs (run on a login node, or "
            "load the slurm module); --dry-run prints the script, and without --slurm it runs here"
        )
    return exe


def submit(script: Path, *, dependency: str | None = None) -> str:
    """sbatch the script; the job id."""
    cmd = [sbatch_executable(), "--parsable", *([f"--dependency={dependency}"] if dependency else []), str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        raise UserError(f"sbatch {script} failed: {reason}")
    return out.stdout.strip().split(";")[0]  # "id;cluster" on a federation


def _setting(slurm: SlurmSection, cluster: ClusterFile, key: str, default=None):
    """The recipe's value if it sets one, else the cluster file's, else the default."""
    value = getattr(slurm, key)
    if value is None:
        value = getattr(cluster, key)
    return default if value is None else value


def _device(recipe: Recipe, cluster: ClusterFile, where: str) -> str:
    device = recipe.launch.device
    if device == "auto":
        return "cpu" if cluster.gpus_per_node == 0 else "cuda"
    if device == "cuda" and cluster.gpus_per_node == 0:
        raise UserError(f"launch.device: cuda, but {where} says its nodes have no GPUs (gpus_per_node: 0)")
    return device


def _check_size(recipe: Recipe, cluster: ClusterFile, device: str, where: str) -> None:
    launch = recipe.launch
    if device == "cuda" and cluster.gpus_per_node is not None and launch.nproc_per_node > cluster.gpus_per_node:
        raise UserError(
            f"launch.nproc_per_node: {launch.nproc_per_node} GPUs per node asked, but {where} "
            f"says a node has {cluster.gpus_per_node} (gpus_per_node); use more nodes instead"
        )
    if cluster.max_nodes is not None and launch.nnodes > cluster.max_nodes:
        raise UserError(
            f"launch.nnodes: {launch.nnodes} nodes asked, but {where} allows at most {cluster.max_nodes} (max_nodes)"
        )


def plan_training(
    recipe: Recipe,
    recipe_path: str | Path,
    overrides: list[str],
    cluster: ClusterFile,
    cluster_path: Path | None = None,
) -> Planned:
    launch, slurm = recipe.launch, recipe.launch.slurm
    where = f"the cluster file {cluster_path}" if cluster_path else "the cluster file"
    device = _device(recipe, cluster, where)
    _check_size(recipe, cluster, device, where)
    run_dir = Path(recipe.checkpoint.dir).resolve()
    log_dir = Path(slurm.log_dir or run_dir / "slurm").resolve()
    per_node = launch.nproc_per_node
    cpus = _setting(slurm, cluster, "cpus_per_task")
    torchrun = slurm.launcher == "torchrun"
    if launch.max_restarts and not torchrun:
        raise UserError(
            f"launch.max_restarts = {launch.max_restarts} needs launch.slurm.launcher: torchrun "
            "(under srun nothing restarts the processes; launch.slurm.requeue requeues the job)"
        )
    resources = Resources(
        job_name=recipe.name,
        nodes=launch.nnodes,
        ntasks_per_node=1 if torchrun else per_node,
        gpus_per_node=per_node if device == "cuda" else 0,
        gpu_request=cluster.gpu_request,
        cpus_per_task=cpus * per_node if (cpus and torchrun) else cpus,
        time=_setting(slurm, cluster, "time", DEFAULT_TIME),
        partition=_setting(slurm, cluster, "partition"),
        account=_setting(slurm, cluster, "account"),
        qos=_setting(slurm, cluster, "qos"),
        output=str(log_dir / "%x-%j.out"),
        chdir=os.getcwd(),
        signal=f"B:USR1@{slurm.signal_lead_s}",
        requeue=slurm.requeue,
        extra=[*cluster.sbatch_args, *slurm.sbatch_args],
    )
    env = {**(GPU_ENV if device == "cuda" else CPU_ENV), **cluster.env, **launch.env}
    script = run_dir / "slurm" / "train.sbatch"
    title = [
        f"Training job for recipe '{recipe.name}', written by `setdiff launch {recipe_path} --slurm`.",
        f"{launch.nnodes} node(s) x {per_node} {'GPU' if device == 'cuda' else 'CPU'} processes, "
        f"launcher {slurm.launcher}; cluster file: {cluster_path or 'none'}. Resubmit: sbatch {script}",
    ]
    text = render_train(
        resources,
        run=recipe_lines(str(Path(recipe_path).resolve()), list(overrides)),
        launcher=slurm.launcher,
        nproc_per_node=per_node,
        run_dir=str(run_dir),
        setup=[*cluster.setup, *slurm.setup],
        env=env,
        srun_args=[*cluster.srun_args, *slurm.srun_args],
        requeue=slurm.requeue,
        title=title,
        max_restarts=launch.max_restarts,
    )
    return Planned(text, script, resources.output, resources.gpus_per_node)


def _write(planned: Planned) -> None:
    planned.path.parent.mkdir(parents=True, exist_ok=True)
    Path(planned.output).parent.mkdir(parents=True, exist_ok=True)
    planned.path.write_text(planned.text)


def _log_path(output: str, job_name: str, job_id: str) -> str:
    return output.replace("%x", job_name).replace("%j", job_id).replace("%A", job_id)


def launch_slurm(recipe_path: str, overrides: list[str], *, dry_run: bool = False) -> int:
    """`setdiff launch RECIPE --slurm`: render, write and submit the training job."""
    recipe = load_recipe(recipe_path, overrides)
    cluster, cluster_path = load_cluster_file(recipe.launch.slurm.cluster_file)
    planned = plan_training(recipe, recipe_path, overrides, cluster, cluster_path)  # checks the cluster's limits
    # The recipe is checked for the compute nodes, not for this (login) machine's GPUs; a dry run
    # renders anywhere, without the recipe's data and tokenizer files.
    from setdiff_megatron.training.preflight import check_run

    check_run(recipe, recipe_path, has_gpu=planned.gpus_per_node > 0, files=not dry_run, checkpoint_dir=not dry_run)
    if dry_run:
        print(planned.text, end="")
        return 0
    sbatch_executable()
    _write(planned)
    job_id = submit(planned.path)
    log = _log_path(planned.output, recipe.name, job_id)
    print(f"submitted job {job_id}: {planned.path}")
    print(f"log: {log}")
    print(f"run: {Path(recipe.checkpoint.dir).resolve()} (metrics in logs/metrics.jsonl)")
    print(f"watch: squeue -j {job_id}; tail -f {log}   stop with a checkpoint: scancel --signal=USR1 --batch {job_id}")
    return 0


def submit_sharded(
    command: str | list[str],
    merge_command: str | list[str],
    *,
    num_shards: int,
    work_dir: str | Path,
    job_name: str = "setdiff-shards",
    slurm: SlurmSection | None = None,
    gpus_per_shard: int = 0,
    max_parallel: int | None = None,
    env: dict[str, str] | None = None,
    dry_run: bool = False,
) -> ShardedJobs:
    """An array job running `command` once per shard, then `merge_command` once all succeeded.

    `command` holds {shard} and {num_shards}; a string is a shell line, a list is quoted per
    argument. Scripts and logs go to <work_dir>/slurm/. Partition, account, time, set-up and env
    come from `slurm` over the cluster file, as for training."""
    if num_shards < 1:
        raise UserError(f"num_shards must be at least 1, got {num_shards}")
    slurm = slurm or SlurmSection()
    cluster, _ = load_cluster_file(slurm.cluster_file)
    out = Path(work_dir).resolve() / "slurm"

    def resources(name: str, output: str, array: str | None = None) -> Resources:
        return Resources(
            job_name=name,
            array=array,
            gpus_per_node=gpus_per_shard,
            gpu_request=cluster.gpu_request,
            cpus_per_task=_setting(slurm, cluster, "cpus_per_task"),
            time=_setting(slurm, cluster, "time", DEFAULT_TIME),
            partition=_setting(slurm, cluster, "partition"),
            account=_setting(slurm, cluster, "account"),
            qos=_setting(slurm, cluster, "qos"),
            output=str(out / output),
            chdir=os.getcwd(),
            extra=[*cluster.sbatch_args, *slurm.sbatch_args],
        )

    setup = [*cluster.setup, *slurm.setup]
    job_env = {
        **({} if gpus_per_shard else {"CUDA_VISIBLE_DEVICES": ""}),
        "PYTHONUNBUFFERED": "1",
        **cluster.env,
        **(env or {}),
    }
    array = f"0-{num_shards - 1}" + (f"%{max_parallel}" if max_parallel else "")
    array_res = resources(job_name, "%x-%A_%a.out", array)
    jobs = ShardedJobs(
        array=Planned(
            render_array(
                array_res,
                command,
                num_shards=num_shards,
                setup=setup,
                env=job_env,
                title=[f"{num_shards} shards of a job; the merge job {job_name}-merge follows."],
            ),
            out / f"{job_name}.sbatch",
            array_res.output,
        ),
        merge=Planned(
            render_command(
                resources(f"{job_name}-merge", "%x-%j.out"),
                merge_command,
                setup=setup,
                env=job_env,
                title=[f"Merges the shards of {job_name}; submitted with --dependency=afterok on the array job."],
            ),
            out / f"{job_name}-merge.sbatch",
            str(out / "%x-%j.out"),
        ),
    )
    if dry_run:
        return jobs
    sbatch_executable()
    _write(jobs.array)
    _write(jobs.merge)
    jobs.array_id = submit(jobs.array.path)
    jobs.merge_id = submit(jobs.merge.path, dependency=f"afterok:{jobs.array_id}")
    return jobs
