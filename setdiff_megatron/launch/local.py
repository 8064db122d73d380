"""Starting a recipe's processes on this machine with torchrun semantics.

Multi-node SLURM launches render an sbatch script instead (slurm/); this is the local path a
laptop or a single GPU node uses.
"""

from __future__ import annotations

import os
import shlex
import subprocess

from setdiff_megatron.distributed.runtime import torchrun_argv
from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes import Recipe


def torchrun_command(recipe: Recipe, recipe_path: str, overrides: list[str]) -> list[str]:
    launch = recipe.launch
    if launch.nnodes > 1:
        raise UserError("launch.nnodes > 1 needs a cluster launcher; run it through SLURM (see slurm/)")
    return torchrun_argv(launch.nproc_per_node, ["train", recipe_path, *overrides])


def launch_local(recipe: Recipe, recipe_path: str, overrides: list[str], *, dry_run: bool = False) -> int:
    cmd = torchrun_command(recipe, recipe_path, overrides)
    if dry_run:
        print(shlex.join(cmd))
        return 0
    env = {**os.environ, **recipe.launch.env}
    return subprocess.call(cmd, env=env)
