"""megatron-core's MoE layer on the CPU over gloo through the compatibility layer: expert
parallelism 2 equals EP = 1 (moe_worker.py), the ground issue 21's MoE bodies build on."""

import pytest

from tests.megatron.cases import run_worker

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory) -> dict:
    return run_worker("tests.megatron.moe_worker", tmp_path_factory.mktemp("moe") / "moe.json", nproc=2)


def test_expert_parallel_all_to_all_equals_one_rank_holding_every_expert(moe_results):
    assert moe_results["every_expert_used"] and moe_results["expert_grad_norm"] > 0
    for key in ("out", "x_grad", "router_grad"):
        assert moe_results[key] <= 1e-6, (key, moe_results)
    # Summed in another order over the ranks: equal to float32 rounding of the gradient's size.
    assert moe_results["expert_grads"] <= 1e-7 * moe_results["expert_grad_norm"], moe_results
