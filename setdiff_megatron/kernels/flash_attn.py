"""Set-causal attention on flash-attn 2's low-level calls: the alternative where TE is absent.

It drives the private `_flash_attn_forward` / `_flash_attn_backward`, since the public
`flash_attn_func`'s backward drops the log-sum-exp gradient a merge needs (docs/method.md,
"Fused kernels"), and reads the sampling step's cache with `flash_attn_with_kvcache`. FA3
(hopper/) is not wired: on Hopper TE's cuDNN path is the preferred kernel. Tests substitute
tests/kernels/emulation.py's `flash_api()`, which has the same call signatures.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from setdiff_megatron.core.merged_attention import merged_set_causal_attention
from setdiff_megatron.core.step_attention import merged_step_attention
from setdiff_megatron.kernels.te_fused import require_cuda_half

__all__ = ["FlashAttnKernel", "load_flash_api", "flash_status", "flash_attention", "flash_step_attention"]

FLASH_INSTALL = "pip install flash-attn --no-build-isolation"


@functools.cache
def load_flash_api() -> SimpleNamespace:
    import flash_attn
    from flash_attn import flash_attn_interface as fa

    version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2])
    if not (2, 7) <= version < (3, 0):
        raise ImportError(f"flash-attn {flash_attn.__version__} found; 2.7 <= version < 3 needed")
    return SimpleNamespace(
        name=f"flash-attn {flash_attn.__version__}",
        forward=fa._flash_attn_forward,
        backward=fa._flash_attn_backward,
        with_kvcache=fa.flash_attn_with_kvcache,
    )


@functools.cache
def flash_status() -> tuple[bool, str]:
    """(usable, why) for this machine: an sm80+ GPU and flash-attn 2.7+ that imports."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 0):
        return False, "flash-attn 2 needs an sm80+ GPU"
    try:
        return True, load_flash_api().name
    except Exception as exc:  # noqa: BLE001 - a broken CUDA extension raises more than ImportError
        return False, f"flash-attn does not import ({type(exc).__name__}: {str(exc).splitlines()[0]})"


def flash_head_dim_reason(head_dim: int) -> str | None:
    if head_dim > 256 or head_dim % 8:
        return f"flash-attn 2 takes head dims that are multiples of 8 up to 256; got {head_dim}"
    return None


class FlashAttnKernel:
    """core.merged_attention.PartialAttention on flash-attn 2: [b, s, h, d] views with a unit last stride.

    The forward returns softmax_lse [b, h, s]; the backward takes the merged output and softmax_lse.
    flash-attn's causal masks are bottom-right, which equals top-left for the square training call."""

    def __init__(self, api: SimpleNamespace):
        self.api = api

    def layout(self, k: torch.Tensor) -> str:
        return "bshd"

    def forward(self, q, k, v, *, scale, causal, kv_len=None):
        qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
        if kv_len is None:
            out, lse, _, rng_state = self.api.forward(qb, kb, vb, 0.0, scale, causal, -1, -1, 0.0, None, False)
        else:  # the sampling step: no mask, per-row key lengths; read-only, so query K/V never enter the cache
            out, lse = self.api.with_kvcache(
                qb,
                kb,
                vb,
                cache_seqlens=kv_len.to(torch.int32),
                softmax_scale=scale,
                causal=False,
                return_softmax_lse=True,
            )
            rng_state = None
        return out.transpose(1, 2), lse, rng_state

    def backward(self, dout, q, k, v, out, lse, aux, *, scale, causal):
        dob, qb, kb, vb, ob = (x.transpose(1, 2) for x in (dout, q, k, v, out))
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qb, kb, vb))
        self.api.backward(
            dob,
            qb,
            kb,
            vb,
            ob,
            lse.contiguous(),  # mha_bwd reads softmax_lse by its data pointer, strides unread
            dq,
            dk,
            dv,
            0.0,
            scale,
            causal,
            -1,
            -1,
            0.0,
            None,
            torch.are_deterministic_algorithms_enabled(),
            aux,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flash_attention(q, k, v, scale, valid_len, *, api: SimpleNamespace | None = None):
    """The 'flash_attn' training implementation (`api`: tests pass tests/kernels/emulation.py's)."""
    if api is None:
        require_cuda_half(q, "flash_attn")
        api = load_flash_api()
    return merged_set_causal_attention(q, k, v, FlashAttnKernel(api), scale=scale, valid_len=valid_len)


def flash_step_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    *,
    num_commit,
    cache_len=None,
    commit_len=None,
    scale=None,
    api: SimpleNamespace | None = None,
):
    """The 'flash_attn' sampling step."""
    if api is None:
        require_cuda_half(q, "flash_attn")
        api = load_flash_api()
    return merged_step_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        FlashAttnKernel(api),
        num_commit=num_commit,
        cache_len=cache_len,
        commit_len=commit_len,
        scale=scale,
    )
