"""Worker processes on this machine: `python -m MODULE ARGS` as N local torchrun processes.

Every command that starts its own workers (`setdiff train` and `launch`, `sample` and `eval` at
--nproc > 1, `serve --nproc`) starts them through `Torchrun`, so they all get the same environment.
They end with the process that started them, however it ends, and torchrun keeps the run's locks
open until the last of them has ended (docs/fault-tolerance.md, "A launcher's death ends its run").
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field

from setdiff_megatron.distributed.child_processes import child_env
from setdiff_megatron.distributed.ownership import held_fds

__all__ = ["RESTART_ENV", "Torchrun"]

RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""For torchrun's workers: with the rendezvous store shared (torch's default), workers restarted by
--max-restarts read the dead attempt's keys and hang in init_process_group (pytorch#135712)."""


@dataclass(frozen=True)
class Torchrun:
    """`python -m MODULE CLI_ARGS` (default: the `setdiff` command) as `nproc` local processes
    under torchrun (run by `launcher`, a module that runs torchrun's `main` and ends it with this
    process), restarted together up to `max_restarts` times when one of them fails. They get `env`
    over this process's environment."""

    nproc: int
    cli_args: Sequence[str]
    module: str = "setdiff_megatron.cli"
    _: KW_ONLY
    env: Mapping[str, str] = field(default_factory=dict)
    launcher: str = "setdiff_megatron.distributed.torchrun"
    max_restarts: int = 0

    @property
    def argv(self) -> list[str]:
        restarts = [f"--max-restarts={self.max_restarts}"] if self.max_restarts else []
        return [
            sys.executable,
            "-m",
            self.launcher,
            "--standalone",
            f"--nproc_per_node={self.nproc}",
            *restarts,
            "-m",
            self.module,
            *self.cli_args,
        ]

    @property
    def environment(self) -> dict[str, str]:
        """This process's environment, `env`, RESTART_ENV and this pid as the one torchrun ends
        with (PARENT_ENV). OMP_NUM_THREADS is torchrun's own
        default for its workers (1) unless set: set here, torchrun prints no banner about it."""
        return child_env({"OMP_NUM_THREADS": "1", **os.environ, **self.env, **RESTART_ENV})

    def start(self) -> subprocess.Popen:
        """The processes started, for a caller that keeps running beside them."""
        return subprocess.Popen(self.argv, env=self.environment, pass_fds=held_fds())

    def run(self) -> int:
        """The processes run to the end: torchrun's exit code (torchrun is killed if this process
        is interrupted while it waits)."""
        with self.start() as proc:
            try:
                return proc.wait()
            except BaseException:
                proc.kill()
                raise
