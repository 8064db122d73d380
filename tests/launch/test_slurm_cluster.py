"""What a missing cluster means for the SLURM tests (slurm_cluster.py): a skip with the reason on a
machine without one, a failure with the reason in CI as root, where .ci/run starts one."""

import pytest

from tests.launch import slurm_cluster
from tests.launch.slurm_cluster import unavailable


@pytest.mark.parametrize(
    "ci, uid, outcome",
    [
        ("true", 0, pytest.fail.Exception),
        (None, 0, pytest.skip.Exception),
        ("true", 1000, pytest.skip.Exception),  # CI without root: .ci/run starts no cluster there
        ("1", 0, pytest.skip.Exception),
    ],
)
def test_a_missing_cluster_fails_only_in_ci_as_root(monkeypatch, ci, uid, outcome):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: uid)
    with pytest.raises(outcome) as raised:
        unavailable("no SLURM cluster: sbatch not found")
    assert str(raised.value).startswith("no SLURM cluster: sbatch not found")


def test_without_sbatch_the_reason_says_how_to_start_one(monkeypatch):
    slurm_cluster.cluster_problem.cache_clear()
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name: None)
    try:
        assert "tools/local_slurm.sh start" in slurm_cluster.cluster_problem()
    finally:
        slurm_cluster.cluster_problem.cache_clear()
