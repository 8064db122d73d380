"""Starting a recipe's processes on this machine with torchrun semantics.

Multi-node SLURM launches render an sbatch script instead (slurm/); this is the local path a
laptop or a single GPU node uses. A UserError in any worker reaches the person once: the workers
hand their messages over through a directory of this launch (errors.report), torchrun runs quiet
about that failure (distributed/torchrun.py), and the launcher raises the lowest rank's message.
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from setdiff_megatron.distributed.workers import RESTART_ENV, Torchrun
from setdiff_megatron.errors import ERROR_DIR_ENV, UserError, handed_over
from setdiff_megatron.recipes import Recipe


def torchrun_command(recipe: Recipe, recipe_path: str, overrides: list[str]) -> list[str]:
    """The recipe's processes under plain torchrun: the command to run by hand."""
    argv = Torchrun(
        _local_processes(recipe),
        ["train", recipe_path, *overrides],
        launcher="torch.distributed.run",
        max_restarts=recipe.launch.max_restarts,
    ).argv
    return ["env", *(f"{k}={v}" for k, v in RESTART_ENV.items()), *argv] if recipe.launch.max_restarts else argv


def _local_processes(recipe: Recipe) -> int:
    launch = recipe.launch
    if launch.nnodes > 1:
        raise UserError("launch.nnodes > 1 needs a cluster launcher; run it through SLURM (see slurm/)")
    return launch.nproc_per_node


def run_workers(
    nproc: int, cli_args: list[str], env: dict[str, str], module: str = "setdiff_megatron.cli", max_restarts: int = 0
) -> int:
    """`python -m MODULE CLI_ARGS` as `nproc` torchrun processes (`env` over this process's
    environment); their exit code, or the UserError one of them met, raised here once (the
    lowest rank's)."""
    with tempfile.TemporaryDirectory(prefix="setdiff-errors-") as error_dir:
        env = {**env, ERROR_DIR_ENV: error_dir}
        code = Torchrun(nproc, cli_args, module, env=env, max_restarts=max_restarts).run()
        message = handed_over(Path(error_dir))
    if message is not None:
        raise UserError(message)
    return code


def launch_local(recipe: Recipe, recipe_path: str, overrides: list[str], *, dry_run: bool = False) -> int:
    """Run the recipe's processes (with its launch.env); a dry run prints `torchrun_command`."""
    if dry_run:
        print(shlex.join(torchrun_command(recipe, recipe_path, overrides)))
        return 0
    return run_workers(
        _local_processes(recipe),
        ["train", recipe_path, *overrides],
        recipe.launch.env,
        max_restarts=recipe.launch.max_restarts,
    )
