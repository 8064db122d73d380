"""`setdiff` as a user runs it, in a new process: the one place tests write the CLI's and torchrun's command lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str | Path) -> list[str]:
    """The command line of `python -m setdiff_megatron.cli ARGS`, for a test that starts it itself."""
    return [sys.executable, "-m", "setdiff_megatron.cli", *map(str, args)]


def torchrun(nproc: int) -> list[str]:
    """The command line that starts what follows it under torchrun, `nproc` processes on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def setdiff(
    *args: str | Path,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """`python -m setdiff_megatron.cli ARGS` run to its end, its output captured as text.

    From `cwd` (the repository, so recipes and assets resolve by their relative paths); with
    `check` (the default) a failure fails the test with the end of its output, without it the
    caller reads the exit code."""
    proc = subprocess.run(cli(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc
