"""The dispatcher: what 'auto' picks and why, the forced GPU names on a machine without them, and
the FP8 rules; TE and flash-attn must never be imported to get here."""

import logging
import subprocess
import sys

import pytest
import torch

from setdiff_megatron.core.attention import ATTENTION_IMPL_NAMES, resolve_attention_impl, set_causal_attention
from setdiff_megatron.core.step_attention import set_causal_step_attention
from setdiff_megatron.errors import UserError
from setdiff_megatron.kernels import choose_attention_impl, flash_attn, te_fused
from setdiff_megatron.kernels.te_fused import FP8Settings, te_attention
from setdiff_megatron.models.config import ModelConfig
from tests.kernels import emulation

DELAYED = FP8Settings("DelayedScaling", True, "e4m3", "e5m2", 448.0, 57344.0, dpa=True)
CURRENT = FP8Settings("Float8CurrentScaling", False, "e4m3", "e5m2", 448.0, 57344.0, dpa=True)


@pytest.fixture
def fresh(monkeypatch):
    """Forget cached choices and logged messages around a test."""
    choose_attention_impl.cache_clear()
    monkeypatch.setattr(te_fused, "_LOGGED", set())
    monkeypatch.setattr(te_fused, "_BACKENDS", {})
    yield monkeypatch
    choose_attention_impl.cache_clear()


def qkv(heads=4, kv_heads=2, length=6, head_dim=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, n, 2 * length, head_dim, generator=gen, dtype=dtype) for n in (heads, kv_heads, kv_heads))


def test_cpu_picks_the_fused_pytorch_path_and_says_why(fresh, caplog):
    choice = choose_attention_impl("cpu", torch.float32, 64)
    assert choice.impl == "fused"
    assert choice.reason == (
        "cpu tensors: Transformer Engine and flash-attn run only on CUDA GPUs; using the fused "
        "decomposition on PyTorch's cpu flash kernel"
    )
    q, k, v = qkv()
    with caplog.at_level(logging.INFO, logger="setdiff_megatron.kernels"):
        out = set_causal_attention(q, k, v, impl="auto")
        set_causal_attention(q, k, v, impl="auto")
    reason = choose_attention_impl("cpu", torch.float32, 16).reason
    assert [r.getMessage() for r in caplog.records] == [
        f"attention_impl auto -> fused for cpu torch.float32 head_dim 16: {reason}"
    ]
    torch.testing.assert_close(out, set_causal_attention(q, k, v, impl="fused"), rtol=0, atol=0)
    assert torch.equal(
        set_causal_step_attention(q, k, v, k, v, num_commit=3, impl="auto"),
        set_causal_step_attention(q, k, v, k, v, num_commit=3),
    )


def test_cuda_ranking(fresh):
    """TE first, flash-attn next, PyTorch's own flash kernel last; fp32 goes to masked SDPA."""
    fresh.setattr(te_fused, "load_te_api", emulation.te_api)
    status = {"te": (True, "Transformer Engine 2.11"), "fa": (True, "flash-attn 2.8.3")}
    fresh.setattr(te_fused, "te_status", lambda: status["te"])
    fresh.setattr(flash_attn, "flash_status", lambda: status["fa"])
    assert choose_attention_impl("cuda", torch.bfloat16, 128).impl == "te"
    assert choose_attention_impl("cuda", torch.float32, 128).impl == "sdpa"
    assert "flash-attn 2 takes head dims" in choose_attention_impl("cuda", torch.bfloat16, 512).reason
    assert choose_attention_impl("cuda", torch.bfloat16, 512).impl == "fused"  # cuDNN and FA2 stop at 256
    status["te"] = (False, "no CUDA GPU")
    choose_attention_impl.cache_clear()
    choice = choose_attention_impl("cuda", torch.float16, 64)
    assert choice == ("flash_attn", "flash-attn 2.8.3 (Transformer Engine: no CUDA GPU)")
    status["fa"] = (False, "flash-attn does not import (ModuleNotFoundError: No module named 'flash_attn')")
    choose_attention_impl.cache_clear()
    assert choose_attention_impl("cuda", torch.float16, 64).impl == "fused"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error; a GPU machine runs the kernels")
@pytest.mark.parametrize("impl,needs", [("te", "transformer-engine"), ("flash_attn", "flash-attn")])
def test_forcing_a_gpu_kernel_here_is_a_one_line_user_error(impl, needs):
    with pytest.raises(UserError) as err:
        resolve_attention_impl(impl)
    message = str(err.value)
    assert "\n" not in message and f"'{impl}' cannot run here (no CUDA GPU)" in message
    assert needs in message and "model.attention_impl: auto" in message
    q, k, v = qkv()
    with pytest.raises(UserError, match="runs on CUDA GPUs only"):
        (te_attention if impl == "te" else flash_attn.flash_attention)(q, k, v, 0.25, None)


def test_fp8_with_a_head_dim_the_kernel_cannot_take(fresh, caplog):
    """Forced 'te': a one-line UserError naming the fixes. 'auto': BF16 attention, said once."""
    q, k, v = qkv(head_dim=64, dtype=torch.bfloat16)
    api = emulation.te_api(capability=(9, 0), fp8=DELAYED)
    with pytest.raises(UserError) as err:
        te_attention(q, k, v, 0.125, None, api=api)
    assert str(err.value) == (
        "FP8 attention (train.fp8_dot_product_attention): cuDNN's FP8 attention trains only head_dim 128 on sm90; "
        "got 64; set model.head_dim: 128, or train.fp8_dot_product_attention: false (FP8 GEMMs, BF16 attention), "
        "or model.attention_impl: auto"
    )
    bf16 = te_attention(q, k, v, 0.125, None, api=emulation.te_api())
    with caplog.at_level(logging.INFO, logger="setdiff_megatron.kernels"):
        for _ in range(2):
            assert torch.equal(te_attention(q, k, v, 0.125, None, api=api, strict=False), bf16)
    assert len(caplog.records) == 1 and "runs in torch.bfloat16" in caplog.records[0].getMessage()
    with pytest.raises(UserError, match="needs Hopper"):
        te_attention(q, k, v, 0.125, None, api=emulation.te_api(capability=(8, 0), fp8=DELAYED))
    # Blackwell takes head dims up to 128; current scaling has no FP8 attention on Hopper: BF16.
    assert not torch.equal(
        te_attention(q, k, v, 0.125, None, api=emulation.te_api(capability=(10, 0), fp8=DELAYED)), bf16
    )
    assert torch.equal(te_attention(q, k, v, 0.125, None, api=emulation.te_api(fp8=CURRENT)), bf16)


def test_fp8_config_cudnn_refuses(fresh):
    """cuDNN has no FP8 kernel for a shape: forced 'te' says so, 'auto' runs that call in BF16."""
    q, k, v = qkv(head_dim=128, dtype=torch.bfloat16)
    api = emulation.te_api(fp8=DELAYED)
    api.fused_backend = lambda is_training, dtype, *rest: None if dtype == "e4m3" else "F16_arbitrary_seqlen"
    with pytest.raises(UserError, match="has no fused FP8 attention for head_dim 128"):
        te_attention(q, k, v, 0.1, None, api=api)
    bf16 = te_attention(q, k, v, 0.1, None, api=emulation.te_api())
    assert torch.equal(te_attention(q, k, v, 0.1, None, api=api, strict=False), bf16)


def test_fp8_gemms_alone_leave_attention_in_bf16_as_megatron_does(fresh):
    """An fp8 autocast whose recipe has no fp8_dpa (megatron's default): BF16 attention."""
    q, k, v = qkv(head_dim=128, dtype=torch.bfloat16)
    gemms_only = FP8Settings("DelayedScaling", True, "e4m3", "e5m2", 448.0, 57344.0)
    bf16 = te_attention(q, k, v, 0.1, None, api=emulation.te_api())
    assert torch.equal(te_attention(q, k, v, 0.1, None, api=emulation.te_api(fp8=gemms_only)), bf16)
    assert not torch.equal(te_attention(q, k, v, 0.1, None, api=emulation.te_api(fp8=DELAYED)), bf16)


def test_te_python_guards_are_honoured(fresh):
    """TE turns FP8 attention off on sm120 and under deterministic training, and every fused
    attention off for deterministic training on sm100+ (dot_product_attention/utils.py)."""
    q, k, v = qkv(head_dim=128, dtype=torch.bfloat16)
    with pytest.raises(UserError, match="turns FP8 attention off on sm120"):
        te_attention(q, k, v, 0.1, None, api=emulation.te_api(capability=(12, 0), fp8=DELAYED))
    fresh.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    with pytest.raises(UserError, match="no FP8 fused attention for deterministic training"):
        te_attention(q, k, v, 0.1, None, api=emulation.te_api(fp8=DELAYED))
    with pytest.raises(UserError, match="no deterministic fused attention for training on sm100"):
        te_attention(q, k, v, 0.1, None, api=emulation.te_api(capability=(10, 0)))
    fresh.setattr(torch.cuda, "is_available", lambda: True)
    fresh.setattr(te_fused, "te_status", lambda: (True, "emulation"))
    fresh.setattr(te_fused, "load_te_api", lambda: emulation.te_api(capability=(10, 0)))
    assert choose_attention_impl("cuda", torch.bfloat16, 128).impl != "te"


def test_a_backend_without_a_log_sum_exp_is_refused(fresh):
    """cuDNN 9.10.0-9.10.1 leave TE only its max512 backend for this shape, which returns the
    softmax itself; and a call that returns no [b, h, sq, 1] statistics is refused too."""
    q, k, v = qkv(heads=4, kv_heads=4, length=64, head_dim=64, dtype=torch.bfloat16)
    q = q[:, :, 64:]  # the last layer's query rows: 4 heads on 4, 64 x 64 causal, max512's shape
    with pytest.raises(UserError, match="max512 backend"):
        te_attention(q, k, v, 0.1, None, api=emulation.te_api(cudnn=(9, 10, 0)))
    api = emulation.te_api()
    forward = api.fused_attn_fwd
    api.fused_attn_fwd = lambda *a, **kw: (forward(*a, **kw)[0], [torch.zeros(2, 4, 64, 64, dtype=torch.bfloat16)])
    assert te_attention(q, k, v, 0.1, None, api=emulation.te_api()).shape == q.shape  # cuDNN 9.13: arbitrary
    with pytest.raises(UserError, match=r"returned no log-sum-exp \[b, h, sq, 1\] float32"):
        te_attention(q, k, v, 0.1, None, api=api)


def test_unsupported_te_config_is_a_user_error():
    q, k, v = qkv(head_dim=512)
    with pytest.raises(UserError, match="has no fused float32 attention for head_dim 512.*auto or fused"):
        te_attention(q, k, v, 0.1, None, api=emulation.te_api())


def test_config_takes_the_new_names_and_checks_only_spelling():
    """A GPU recipe must validate on a CPU login node: the machine check comes at model build."""
    for name in ("auto", "te", "flash_attn", "fused", "sdpa", "dense"):
        assert ModelConfig(attention_impl=name).attention_impl == name
    with pytest.raises(ValueError, match=r"attention_impl must be one of \['auto', 'dense', 'flash_attn'"):
        ModelConfig(attention_impl="flash9")
    assert ATTENTION_IMPL_NAMES == ("auto", "dense", "flash_attn", "fused", "sdpa", "te")


def test_the_kernels_register_exactly_the_names_a_config_takes():
    """models/config.py checks spelling against core's name list without importing the kernels;
    importing them registers exactly those names, and kernel steps only under them."""
    code = (
        "import sys, setdiff_megatron.models.config; "
        "print('setdiff_megatron.kernels' in sys.modules); "
        "import setdiff_megatron.kernels; "
        "from setdiff_megatron.core.attention import ATTENTION_IMPL_NAMES, ATTENTION_IMPLS; "
        "from setdiff_megatron.core.step_attention import STEP_IMPLS; "
        "print(tuple(sorted(ATTENTION_IMPLS)) == ATTENTION_IMPL_NAMES, set(STEP_IMPLS) <= set(ATTENTION_IMPL_NAMES))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["False", "True", "True"]


def test_importing_the_kernels_imports_no_gpu_package():
    code = (
        "import sys, setdiff_megatron.kernels, setdiff_megatron.models.config; "
        "print([m for m in sys.modules if m.split('.')[0] in ('transformer_engine', 'flash_attn')])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
