"""Building the megatron body: layer specs and the TE backend on a CPU machine.
(Numerical behaviour is covered by test_megatron_torch_parity.py and test_megatron_parallel_parity.py.)"""

import pytest
import torch

from setdiff_megatron.errors import UserError
from tests.conftest import debug_config

megatron_model = pytest.importorskip("setdiff_megatron.models.megatron_model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error; a GPU machine has the backend")
def test_te_backend_without_gpu_is_a_one_line_user_error():
    with pytest.raises(UserError, match="needs a GPU"):
        megatron_model.layer_spec(debug_config(), "te")
    with pytest.raises(UserError, match="backend must be one of"):
        megatron_model.layer_spec(debug_config(), "apex")


def test_local_spec_swaps_only_attention_and_norms():
    spec, final_norm = megatron_model.layer_spec(debug_config(qk_norm=True))
    attention = spec.submodules.self_attention.submodules
    assert attention.core_attention.module is megatron_model.SetCausalCoreAttention
    assert attention.core_attention.params == {"impl": "fused", "query_rows_only": False}
    last = megatron_model.query_rows_layer_spec(spec, debug_config(qk_norm=True)).submodules
    assert last.self_attention.submodules.core_attention.params["query_rows_only"]
    assert last.self_attention.submodules.linear_qkv is attention.linear_qkv
    assert final_norm is attention.q_layernorm is spec.submodules.input_layernorm is megatron_model.RMSNorm
    assert attention.linear_qkv.__name__ == "ColumnParallelLinear"
