"""Building the megatron model: layout validation and the TE backend on a CPU machine.
(Numerical behaviour is covered by test_torch_parity.py and test_parallel_parity.py.)"""

import pytest
import torch

from setdiff_megatron.errors import UserError
from tests.conftest import debug_config

megatron_model = pytest.importorskip("setdiff_megatron.models.megatron_model")


@pytest.mark.parametrize(
    "layout,message",
    [
        (dict(tp=3), "num_heads"),
        (dict(tp=4), "num_kv_heads"),
        (dict(pp=3), "num_layers"),
        (dict(pp=2, vpp=2), "4 pipeline chunks"),
        (dict(recompute="some"), "recompute"),
    ],
)
def test_impossible_layouts_are_user_errors(layout, message):
    with pytest.raises(UserError, match=message):
        megatron_model.transformer_config_from(debug_config(), **layout)


def test_config_mirrors_the_model_config():
    cfg = debug_config(qk_norm=True)
    tc = megatron_model.transformer_config_from(
        cfg, tp=2, sequence_parallel=True, recompute="full", params_dtype=torch.bfloat16, hidden_dropout=0.1
    )
    assert (tc.num_query_groups, tc.kv_channels, tc.ffn_hidden_size) == (2, 16, cfg.intermediate_size)
    assert tc.gated_linear_unit and tc.qk_layernorm and tc.normalization == "RMSNorm"
    assert (tc.sequence_parallel, tc.recompute_granularity, tc.recompute_method) == (True, "full", "uniform")
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.hidden_dropout == 0.1
    assert tc.calculate_per_token_loss and tc.batch_p2p_comm
    assert not megatron_model.transformer_config_from(cfg, sequence_parallel=True).sequence_parallel  # tp == 1
    assert not megatron_model.transformer_config_from(cfg, pp=2, vpp=1).batch_p2p_comm


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
