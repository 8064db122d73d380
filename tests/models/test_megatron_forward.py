"""The TransformerConfig translation of models/megatron_forward.py: layout validation and the
fields a ModelConfig sets. (Chunks, forward_step and loss_func run in the multi-process tests,
test_megatron_torch_parity.py and test_megatron_parallel_parity.py.)"""

import pytest
import torch

from setdiff_megatron.errors import UserError
from tests.conftest import debug_config

megatron_forward = pytest.importorskip("setdiff_megatron.models.megatron_forward")


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
        megatron_forward.transformer_config_from(debug_config(), **layout)


def test_config_mirrors_the_model_config():
    cfg = debug_config(qk_norm=True)
    tc = megatron_forward.transformer_config_from(
        cfg, tp=2, sequence_parallel=True, recompute="full", params_dtype=torch.bfloat16, hidden_dropout=0.1
    )
    assert (tc.num_query_groups, tc.kv_channels, tc.ffn_hidden_size) == (2, 16, cfg.intermediate_size)
    assert tc.gated_linear_unit and tc.qk_layernorm and tc.normalization == "RMSNorm"
    assert (tc.sequence_parallel, tc.recompute_granularity, tc.recompute_method) == (True, "full", "uniform")
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.hidden_dropout == 0.1
    assert tc.calculate_per_token_loss and tc.batch_p2p_comm
    assert not megatron_forward.transformer_config_from(cfg, sequence_parallel=True).sequence_parallel  # tp == 1
    assert not megatron_forward.transformer_config_from(cfg, pp=2, vpp=1).batch_p2p_comm
