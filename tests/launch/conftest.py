"""SLURM test set-up: tests marked `slurm` need a running cluster and are skipped, with the
reason, where there is none. Start one on this machine with `tools/local_slurm.sh start` (root).

Every test isolates the cluster-file lookup (no $SETDIFF_CLUSTER_FILE, no ~/.config) and puts
the repository first on PYTHONPATH, so jobs (which inherit the environment of `sbatch`) run
this checkout's `setdiff`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "no SLURM cluster: sbatch not found (start one with `tools/local_slurm.sh start`, as root)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no SLURM cluster: sinfo failed ({exc})"
    states = out.stdout.split()
    if out.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states):
        reason = (out.stderr.strip().splitlines() or [" ".join(states) or "no nodes"])[-1]
        return f"no usable SLURM cluster: sinfo says {reason!r} (tools/local_slurm.sh start)"
    return None


def pytest_collection_modifyitems(config, items):
    slurm_items = [i for i in items if i.get_closest_marker("slurm")]
    if slurm_items and (problem := _cluster_problem()):
        for item in slurm_items:
            item.add_marker(pytest.mark.skip(reason=problem))


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path_factory):
    config_home = tmp_path_factory.mktemp("config")
    monkeypatch.delenv("SETDIFF_CLUSTER_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
