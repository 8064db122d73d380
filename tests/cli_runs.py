"""`setdiff` as a user runs it, in a new process: the one helper tests start the CLI with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setdiff(
    *args: str | Path,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """`python -m setdiff_megatron.cli ARGS` from `cwd` (the repository, so recipes and assets
    resolve by their relative paths), its output captured as text; with `check` (the default) a
    failure fails the test with the end of its output, without it the caller reads the exit code."""
    proc = subprocess.run(
        [sys.executable, "-m", "setdiff_megatron.cli", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc
