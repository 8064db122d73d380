"""Which set-causal attention runs: 'auto', and the forced GPU names 'te' and 'flash_attn'.

`choose_attention_impl(device_type, dtype, head_dim)` ranks what this machine can run, best first:
  te          Transformer Engine's fused (cuDNN) attention, BF16 or FP8 (CUDA, bf16/fp16)
  flash_attn  flash-attn 2's kernels (CUDA sm80+, bf16/fp16)
  fused       the same decomposition on PyTorch's own flash kernels (CPU any dtype; CUDA bf16/fp16)
  sdpa        the 2L x 2L mask through SDPA (CUDA fp32, which the fused kernels do not take)
('dense' is the reference and never chosen.) 'auto' logs its choice and the reason once per
(device, dtype, head dim). A forced name that cannot run here is a one-line UserError naming the
fix, raised when a model resolves it. Importing this module registers 'auto', 'te' and
'flash_attn' (training and sampling step) with core/attention.py and core/step_attention.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from setdiff_megatron.core.attention import ATTENTION_IMPLS, register_attention_impl
from setdiff_megatron.core.merged_attention import ATEN_FLASH, PartialAttention
from setdiff_megatron.core.step_attention import register_step_impl, set_causal_step_attention
from setdiff_megatron.errors import UserError
from setdiff_megatron.kernels import flash_attn, te_fused
from setdiff_megatron.kernels.te_fused import HALF, log_once

__all__ = ["Choice", "choose_attention_impl", "context_parallel_kernel"]


class Choice(NamedTuple):
    impl: str
    reason: str


def _te_reason(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why TE's fused attention cannot train this head dim here: TE's Python guard, or no backend
    that returns a log-sum-exp (te_fused.TEFusedKernel)."""
    api = te_fused.load_te_api()
    if (reason := te_fused.fused_unavailable_reason(api.capability(torch.device("cuda")))) is not None:
        return reason
    backend = api.fused_backend(True, api.te_dtype(dtype), "bshd", "causal", 2, 1, 128, 128, head_dim)
    if backend != api.backend_names["F16"]:
        return f"no cuDNN fused attention with a log-sum-exp for {dtype} head_dim {head_dim}"
    return None


@functools.cache
def choose_attention_impl(device_type: str, dtype: torch.dtype, head_dim: int) -> Choice:
    """The best implementation for tensors of this device type, dtype and head dim, and why."""
    if device_type != "cuda":
        return Choice(
            "fused",
            f"{device_type} tensors: Transformer Engine and flash-attn run only on CUDA GPUs; "
            f"using the fused decomposition on PyTorch's {device_type} flash kernel",
        )
    if dtype not in HALF:
        return Choice(
            "sdpa",
            f"{dtype} on CUDA: the fused kernels take bf16/fp16 only; using SDPA with the "
            "2L x 2L set-causal mask (train.precision: bf16 enables them)",
        )
    te_ok, te_why = te_fused.te_status()
    if te_ok:
        reason = _te_reason(dtype, head_dim)
        if reason is None:
            return Choice(
                "te",
                f"{te_why}: one fused (cuDNN) causal call for both streams, log-sum-exp merge "
                "(FP8 under train.fp8_dot_product_attention)",
            )
        te_why = reason
    fa_ok, fa_why = flash_attn.flash_status()
    if fa_ok and (reason := flash_attn.flash_head_dim_reason(head_dim)) is not None:
        fa_ok, fa_why = False, reason
    if fa_ok:
        return Choice("flash_attn", f"{fa_why} (Transformer Engine: {te_why})")
    return Choice("fused", f"PyTorch's bundled flash kernel (Transformer Engine: {te_why}; flash-attn: {fa_why})")


def _choice_for(q: torch.Tensor) -> Choice:
    choice = choose_attention_impl(q.device.type, q.dtype, q.shape[-1])
    log_once(
        ("auto", q.device.type, q.dtype, q.shape[-1]),
        f"attention_impl auto -> {choice.impl} for {q.device.type} {q.dtype} head_dim {q.shape[-1]}: {choice.reason}",
    )
    return choice


def auto_attention(q, k, v, scale, valid_len):
    choice = _choice_for(q)
    if choice.impl == "te":
        return te_fused.te_attention(q, k, v, scale, valid_len, strict=False)
    return ATTENTION_IMPLS[choice.impl](q, k, v, scale, valid_len)


def context_parallel_kernel(impl: str, q: torch.Tensor) -> PartialAttention:
    """The per-block kernel of ring attention (kernels/ring_attention.py) for model.attention_impl:
    TE's or flash-attn's low-level calls, else PyTorch's flash kernels ('fused'; 'sdpa' and
    'dense' have no blockwise form, and under context parallelism run the same kernels)."""
    if impl == "auto":
        impl = _choice_for(q).impl
    if impl == "te":
        te_fused.require_cuda_half(q, "te")
        return te_fused.te_kernel_for(q, te_fused.load_te_api(), strict=False)
    if impl == "flash_attn":
        te_fused.require_cuda_half(q, "flash_attn")
        return flash_attn.FlashAttnKernel(flash_attn.load_flash_api())
    return ATEN_FLASH


def auto_step_attention(q, k, v, k_cache, v_cache, **kwargs):
    step = {"te": te_fused.te_step_attention, "flash_attn": flash_attn.flash_step_attention}.get(_choice_for(q).impl)
    if step is None:  # the masked SDPA step is exact and cheap off the GPU kernels
        return set_causal_step_attention(q, k, v, k_cache, v_cache, impl="sdpa", **kwargs)
    return step(q, k, v, k_cache, v_cache, **kwargs)


def _check(impl: str, status, install: str):
    def check() -> None:
        ok, why = status()
        if not ok:
            raise UserError(
                f"model.attention_impl '{impl}' cannot run here ({why}); it needs a CUDA GPU and "
                f"`{install}`; use model.attention_impl: auto (or fused)"
            )

    return check


register_attention_impl("auto", auto_attention)
register_attention_impl(
    "te", te_fused.te_attention, check=_check("te", lambda: te_fused.te_status(), te_fused.TE_INSTALL)
)
register_attention_impl(
    "flash_attn",
    flash_attn.flash_attention,
    check=_check("flash_attn", lambda: flash_attn.flash_status(), flash_attn.FLASH_INSTALL),
)
register_step_impl("auto", auto_step_attention)
register_step_impl("te", te_fused.te_step_attention, token_major_cache=True)
register_step_impl("flash_attn", flash_attn.flash_step_attention)
