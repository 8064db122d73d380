"""`setdiff eval ...`: each evaluation module adds its own subcommand."""

from __future__ import annotations

import importlib

# Modules with `add_parser(subparsers)`; their heavy imports stay inside the functions they register.
EVAL_MODULES = (
    "setdiff_megatron.evaluation.likelihood",
    "setdiff_megatron.evaluation.infilling",
    "setdiff_megatron.evaluation.tasks",
    "setdiff_megatron.evaluation.sweep",
    "setdiff_megatron.evaluation.lm_eval_cli",
)


def add_eval_parser(sub) -> None:
    parser = sub.add_parser(
        "eval",
        help="evaluation jobs: likelihood, generation tasks, infilling, sweeps",
        description="Evaluation jobs over a checkpoint or Hugging Face export. Each shards "
        "its examples over --nproc processes (or --shard/--num-shards for SLURM arrays), "
        "resumes where it stopped and merges the results.",
    )
    jobs = parser.add_subparsers(dest="eval_command", metavar="JOB", required=True)
    for name in EVAL_MODULES:
        importlib.import_module(name).add_parser(jobs)
