"""sbatch scripts as text: the training job, a sharded job array, and a one-command job.

Pure functions from resolved settings to a script; nothing here reads a recipe or calls SLURM
(`slurm.py` does both). The scripts are meant to be read: `#SBATCH` resources, set-up lines,
the environment, one `srun`. They hold no training logic (STYLE.md G14), only what the batch
shell alone can do: find the rendezvous host and port, forward the scheduler's early-warning
signal to the training processes, and requeue the job when training exits with code 75 after
its checkpoint (distributed/signals.py).

The templates in slurm/ are this module's output for generic settings (`templates()`); a test
keeps them equal, and `python -m setdiff_megatron.launch.sbatch slurm/` rewrites them.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from setdiff_megatron.distributed.signals import EXIT_REQUEUE, PREEMPTED_FILE
from setdiff_megatron.distributed.workers import RESTART_ENV
from setdiff_megatron.log import say

__all__ = ["Resources", "recipe_lines", "render_train", "render_array", "render_command", "templates"]

SHARD, NUM_SHARDS = "{shard}", "{num_shards}"


@dataclass(kw_only=True)
class Resources:
    """What one sbatch job asks for, and where its output goes."""

    job_name: str
    nodes: int = 1
    ntasks_per_node: int = 1
    gpus_per_node: int = 0
    gpu_request: str = "gpus-per-node"
    """How GPUs are asked for: '--gpus-per-node=N', or 'gres' for '--gres=gpu:N'."""
    cpus_per_task: int | None = None
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    output: str = "%x-%j.out"
    chdir: str | None = None
    array: str | None = None
    signal: str | None = None
    requeue: bool = False
    extra: list[str] = field(default_factory=list)


def _header(r: Resources) -> list[str]:
    opts = [f"--job-name={r.job_name}"]
    if r.array:
        opts.append(f"--array={r.array}")
    opts += [f"--nodes={r.nodes}", f"--ntasks-per-node={r.ntasks_per_node}"]
    if r.cpus_per_task:
        opts.append(f"--cpus-per-task={r.cpus_per_task}")
    if r.gpus_per_node:
        opts.append(
            f"--gres=gpu:{r.gpus_per_node}" if r.gpu_request == "gres" else f"--gpus-per-node={r.gpus_per_node}"
        )
    opts.append(f"--time={r.time}")
    opts += [
        f"--{key}={value}"
        for key, value in (("partition", r.partition), ("account", r.account), ("qos", r.qos))
        if value
    ]
    # append: a requeued job writes to the same file, after the run it continues
    opts += [f"--output={r.output}", "--open-mode=append"]
    if r.chdir:
        opts.append(f"--chdir={r.chdir}")
    if r.signal:
        opts.append(f"--signal={r.signal}")
    if r.requeue:
        opts.append("--requeue")
    return [f"#SBATCH {o}" for o in (*opts, *r.extra)]


def _block(title: str, lines: list[str]) -> list[str]:
    return [f"# {title}", *lines, ""] if lines else []


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {key}={shlex.quote(value)}" for key, value in env.items()]


def _quote(arg: str, shard: str, num_shards: str) -> str:
    """Quote one argument for the shell, with {shard}/{num_shards} left outside the quotes."""
    parts = re.split(r"(\{shard\}|\{num_shards\})", arg)
    out = "".join(
        shard if p == SHARD else num_shards if p == NUM_SHARDS else shlex.quote(p) if p else "" for p in parts
    )
    return out or "''"


def _command(command: str | list[str], shard: str = SHARD, num_shards: str = NUM_SHARDS) -> str:
    """A shell command line: a string is used as written; a list is quoted argument by argument."""
    if isinstance(command, str):
        return command.replace(SHARD, shard).replace(NUM_SHARDS, num_shards)
    return " ".join(_quote(a, shard, num_shards) for a in command)


THREADS = """\
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}  # srun 22.05+ no longer takes it from the job"""

RENDEZVOUS = """\
# Rendezvous: the first node of the allocation, on a port derived from the job id (stable over
# requeues) and moved up while something already listens there.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
while timeout 2 bash -c "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT" 2>/dev/null; do MASTER_PORT=$((MASTER_PORT + 1)); done
export MASTER_PORT
echo "setdiff: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"
"""

# srun runs one process per task; torch.distributed's env:// init reads the rank from these.
SRUN_RANKS = (
    "bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
    'LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; echo "rank $RANK of $WORLD_SIZE on $(hostname)"; '
    'exec "$@"\' rank'
)

TRAP = f"""\
# The scheduler's early warning (--signal=B:USR1@...) reaches this shell only: pass it on to srun,
# which hands it to every training process; they checkpoint at the next step and exit {EXIT_REQUEUE}.
pid=""
trap 'echo "setdiff: SIGUSR1, asking the training processes to checkpoint and stop"; [ -n "$pid" ] && kill -USR1 "$pid"' USR1
"""

WAIT = """\
pid=$!
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done  # a trapped signal interrupts wait
wait "$pid"; code=$?
"""

REQUEUE = f"""\
if [ "$code" -eq {EXIT_REQUEUE} ]; then
  echo "setdiff: training checkpointed and stopped (exit {EXIT_REQUEUE}); requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
"""


def recipe_lines(recipe: str, overrides: list[str]) -> list[str]:
    return [f"RECIPE={shlex.quote(recipe)}", f"OVERRIDES=({' '.join(shlex.quote(o) for o in overrides)})"]


def _title(title: list[str]) -> list[str]:
    return [f"# {t}" if t else "#" for t in title]


def render_train(
    r: Resources,
    *,
    run: list[str],
    launcher: str = "srun",
    nproc_per_node: int = 1,
    run_dir: str | None = None,
    setup: list[str] = (),
    env: dict[str, str] | None = None,
    srun_args: list[str] = (),
    requeue: bool = True,
    title: list[str] = (),
    max_restarts: int = 0,
) -> str:
    """The pretraining job: every node runs `nproc_per_node` processes of `setdiff train`.

    `run` sets RECIPE and the OVERRIDES array (`recipe_lines`). launcher 'srun': one task per
    process; 'torchrun': one task per node running torchrun, which restarts the job's processes
    up to `max_restarts` times and turns a preempted worker into exit code 1, so the run
    directory's PREEMPTED_FILE says 75 instead."""
    lines = [
        "#!/bin/bash",
        *_title(title),
        *_header(r),
        "",
        "set -uo pipefail  # not -e: the exit code of training decides what happens next",
        "",
        TRAP,
        *run,
        "",
    ]
    lines += _block("Set-up", list(setup))
    lines += _block("Environment", [THREADS, *_exports(env or {})])
    lines += [RENDEZVOUS]
    srun = ["srun", "--kill-on-bad-exit=1", "--label", *srun_args]
    if launcher == "torchrun":
        lines += [
            "# One torchrun per node; it starts this node's processes and forwards SIGUSR1 to them.",
            "export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300  # time for the workers' checkpoint",
            *(
                f"export {k}={v}  # restarted workers must not read the dead attempt's rendezvous keys"
                for k, v in RESTART_ENV.items()
            ),
            f"rm -f {shlex.quote(f'{run_dir}/{PREEMPTED_FILE}')}",
            " ".join(
                [
                    *srun,
                    "torchrun",
                    "--nnodes=$SLURM_NNODES",
                    f"--nproc_per_node={nproc_per_node}",
                    f"--max-restarts={max_restarts}",
                    "--rdzv_id=$SLURM_JOB_ID",
                    "--rdzv_backend=c10d",
                    '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"',
                    "\\",
                ]
            ),
            '    -m setdiff_megatron.cli train "$RECIPE" "${OVERRIDES[@]}" &',
        ]
    else:
        lines += [
            "# One training process per task.",
            " ".join([*srun, SRUN_RANKS, "\\"]),
            '    setdiff train "$RECIPE" "${OVERRIDES[@]}" &',
        ]
    lines += [WAIT.rstrip("\n")]
    if launcher == "torchrun":
        lines += [
            f'[ "$code" -ne 0 ] && [ -f {shlex.quote(f"{run_dir}/{PREEMPTED_FILE}")} ] && code={EXIT_REQUEUE}'
            "  # torchrun reports a preempted worker as 1"
        ]
    if requeue:
        lines += [REQUEUE.rstrip("\n")]
    lines += ['exit "$code"', ""]
    return "\n".join(lines)


def render_array(
    r: Resources,
    command: str | list[str],
    *,
    num_shards: int,
    setup: list[str] = (),
    env: dict[str, str] | None = None,
    title: list[str] = (),
) -> str:
    """One array task per shard, running `command` with {shard} -> the array index and
    {num_shards} -> the shard count (`r.array` must hold the indices, e.g. '0-7%4')."""
    lines = ["#!/bin/bash", *_title(title), *_header(r), "", "set -euo pipefail", ""]
    lines += _block("Set-up", list(setup))
    lines += _block("Environment", [THREADS, *_exports(env or {})])
    lines += [
        f'echo "setdiff: shard $SLURM_ARRAY_TASK_ID of {num_shards} (job $SLURM_JOB_ID)"',
        _command(command, '"$SLURM_ARRAY_TASK_ID"', str(num_shards)),
        "",
    ]
    return "\n".join(lines)


def render_command(
    r: Resources,
    command: str | list[str],
    *,
    setup: list[str] = (),
    env: dict[str, str] | None = None,
    title: list[str] = (),
) -> str:
    """A job running one command: a merge step, a conversion."""
    lines = ["#!/bin/bash", *_title(title), *_header(r), "", "set -euo pipefail", ""]
    lines += _block("Set-up", list(setup))
    lines += _block("Environment", [THREADS, *_exports(env or {})])
    lines += [_command(command), ""]
    return "\n".join(lines)


def templates() -> dict[str, str]:
    """slurm/*.sbatch: the scripts above for generic settings, to copy, edit and sbatch by hand."""
    pretrain = render_train(
        Resources(
            job_name="setdiff-train",
            nodes=2,
            ntasks_per_node=8,
            gpus_per_node=8,
            cpus_per_task=8,
            time="04:00:00",
            output="slurm-%x-%j.out",
            signal="B:USR1@300",
            requeue=True,
        ),
        run=["RECIPE=${1:?usage: sbatch slurm/pretrain.sbatch RECIPE [KEY=VALUE ...]}; shift", 'OVERRIDES=("$@")'],
        setup=["# module load cuda; source ~/venvs/setdiff/bin/activate   <- your environment here"],
        env=GPU_ENV,
        title=[
            "Pretraining: N nodes x G GPUs, one srun task (one training process) per GPU.",
            "  sbatch --nodes=2 --gpus-per-node=8 --ntasks-per-node=8 slurm/pretrain.sbatch recipes/owt-110m.yaml",
            "`setdiff launch RECIPE --slurm` writes this script filled in from the recipe and the cluster file",
            "(slurm/README.md). Add --partition/--account to sbatch, and your set-up below. On SIGUSR1 (300 s",
            "before the time limit, or `scancel --signal=USR1 --batch JOBID`) training checkpoints, exits with",
            f"{EXIT_REQUEUE} and the job requeues itself; the requeued job resumes from that checkpoint.",
        ],
    )
    convert = render_command(
        Resources(job_name="setdiff-convert", cpus_per_task=16, time="02:00:00", output="slurm-%x-%j.out"),
        'setdiff convert "$@"',
        title=[
            "Checkpoint conversion (megatron <-> Hugging Face) as a one-node, one-task job, with the",
            "arguments of `setdiff convert`:",
            "  sbatch slurm/convert.sbatch to-hf runs/owt-110m-d8 exports/owt-110m-d8 --check",
            "  sbatch slurm/convert.sbatch from-hf /models/Qwen3-1.7B-Base runs/gsm8k-init",
            "Conversion gathers the whole model into one process: ask for enough memory (--mem).",
        ],
    )
    return {"pretrain.sbatch": pretrain, "convert.sbatch": convert}


# Set on GPU jobs (see slurm/README.md for what each does and the ones a cluster file may add).
GPU_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # megatron: TP/SP communication kernels run in issue order
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed or timed-out collective ends the process, no hang
    "NCCL_DEBUG": "WARN",
    "PYTHONUNBUFFERED": "1",
}
# Set on CPU jobs (launch.device: cpu): no GPU is visible, so the engine takes gloo.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


if __name__ == "__main__":  # python -m setdiff_megatron.launch.sbatch slurm/
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "slurm")
    for name, text in templates().items():
        (out / name).write_text(text)
        say(f"wrote {out / name}")
