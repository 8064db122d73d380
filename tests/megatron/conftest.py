"""Each worker process runs once per session; its tests read the measurements it wrote."""

import pytest

from tests.megatron.cases import run_worker


@pytest.fixture(scope="session")
def single_results(tmp_path_factory) -> dict:
    return run_worker("tests.megatron.single_worker", tmp_path_factory.mktemp("megatron") / "single.json")


@pytest.fixture(scope="session")
def parallel_results(tmp_path_factory) -> dict:
    return run_worker("tests.megatron.parallel_worker", tmp_path_factory.mktemp("megatron") / "parallel.json", nproc=2)
