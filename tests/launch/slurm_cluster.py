"""Whether the SLURM tests can run here, and what a missing cluster means.

On a machine without one, the tests marked `slurm` (and the two-node ones, without partition
`multi`) are skipped with the reason. In CI as root (CI=true, uid 0), .ci/run brings a cluster up
with tools/local_slurm.sh, so one that is missing or short of its two namespace nodes is a broken
set-up, and those tests fail with the reason instead of hiding it behind a skip.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import NoReturn

import pytest

USABLE = ("idle", "mixed", "allocated", "completing")


def cluster_required() -> bool:
    """CI as root, where .ci/run starts the cluster the SLURM tests need."""
    return os.environ.get("CI") == "true" and os.geteuid() == 0


def unavailable(problem: str) -> NoReturn:
    """Skip with `problem`, or fail with it where the cluster is required."""
    if cluster_required():
        pytest.fail(f"{problem}; CI=true as root, where .ci/run starts the cluster, so this fails", pytrace=False)
    pytest.skip(problem)


@functools.cache
def cluster_problem() -> str | None:
    """Why no job can be submitted here, or None; asked once per session."""
    if shutil.which("sbatch") is None:
        return "no SLURM cluster: sbatch not found (start one with `tools/local_slurm.sh start`, as root)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no SLURM cluster: sinfo failed ({exc})"
    states = out.stdout.split()
    if out.returncode != 0 or not any(s.rstrip("*~#") in USABLE for s in states):
        reason = (out.stderr.strip().splitlines() or [" ".join(states) or "no nodes"])[-1]
        return f"no usable SLURM cluster: sinfo says {reason!r} (tools/local_slurm.sh start)"
    return None


def require_two_nodes() -> None:
    """Partition `multi` with two idle nodes (tools/local_slurm.sh's namespace nodes), or
    `unavailable`."""
    out = subprocess.run(["sinfo", "-N", "-h", "-p", "multi", "-o", "%T"], capture_output=True, text=True, timeout=30)
    idle = [s for s in out.stdout.split() if s.rstrip("*~#") in ("idle", "mixed")]
    if len(idle) < 2:
        seen = " ".join(out.stdout.split()) or out.stderr.strip() or "sinfo lists none"
        unavailable(
            f"no partition `multi` with two idle nodes ({seen}); "
            "tools/local_slurm.sh start makes one where network namespaces can be made"
        )
