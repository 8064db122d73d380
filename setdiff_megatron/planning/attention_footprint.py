"""Set-causal attention as a GPU kernel holds it, for a plan made on a machine without one.

On the CPU the training implementations materialise score matrices that the GPU kernels (TE's
fused attention, FlashAttention) never hold: a plan that ran them would count memory a GPU run
does not use. While `kernel_footprint()` lasts, every registered implementation is replaced by
one that allocates what those kernels keep: the output, and for the backward q, k, v, the output
and the float32 log-sum-exp of every row; the backward allocates the three input gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from setdiff_megatron.core import attention

__all__ = ["kernel_footprint"]


class _KernelShaped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _footprint(q, k, v, scale, valid_len):
    return _KernelShaped.apply(q, k, v)


@contextlib.contextmanager
def kernel_footprint() -> Iterator[None]:
    stand_ins = {name: _footprint for name in attention.ATTENTION_IMPLS}
    with mock.patch.dict(attention.ATTENTION_IMPLS, stand_ins), mock.patch.dict(attention._IMPL_CHECKS, clear=True):
        yield
