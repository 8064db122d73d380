"""SLURM test set-up: tests marked `slurm` need a running cluster; where there is none they are
skipped with the reason, or fail with it in CI as root (slurm_cluster.py). Start one on this
machine with `tools/local_slurm.sh start` (root).

Every test isolates the cluster-file lookup (no $SETDIFF_CLUSTER_FILE, no ~/.config) and puts
the repository first on PYTHONPATH, so jobs (which inherit the environment of `sbatch`) run
this checkout's `setdiff`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.launch.slurm_cluster import cluster_problem, unavailable

REPO = Path(__file__).parents[2]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test (the module ones submit jobs)."""
    if item.get_closest_marker("slurm") and (problem := cluster_problem()):
        unavailable(problem)


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path_factory):
    config_home = tmp_path_factory.mktemp("config")
    monkeypatch.delenv("SETDIFF_CLUSTER_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
