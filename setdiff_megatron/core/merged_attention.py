"""The merged set-causal kernel: ONE causal kernel call serves both streams, on any kernel that
returns its log-sum-exp (docs/method.md, "Fused kernels").

The query rows are rotated by one slot (slot r holds query r+1, so plain causal attention gives it
clean ranks <= r, i.e. < r+1) and stacked as extra heads next to the clean heads of the same KV
group. Each query's own key (the diagonal) is merged in through the log-sum-exp. The backward
calls the kernel backward once with the merged output and log-sum-exp, the way ring attention
does, and adds the diagonal gradient analytically. The merge takes any `PartialAttention` kernel:
PyTorch's flash kernels here (`ATEN_FLASH`, attention_impl 'fused'), Transformer Engine's and
flash-attn's low-level calls in setdiff_megatron/kernels/. With q holding the query rows only, the
kernel runs with H heads instead of 2H.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from setdiff_megatron.core.attention_shapes import check_qkv, stream_length, valid_row_mask

__all__ = ["ATEN_FLASH", "PartialAttention", "merged_set_causal_attention"]


class PartialAttention(Protocol):
    """A fused kernel seen through its low-level API: attention under a fixed mask that returns
    the log-sum-exp, and a backward that takes the output and log-sum-exp as INPUTS, so the merge
    can feed it merged ones (as ring attention does).

    q [B, Hq, Sq, D], k/v [B, G, Sk, D] with Hq % G == 0 (query head h reads key/value head
    h // (Hq / G)), any strides; out is like q; lse [B, Hq, Sq] is the natural log of the summed
    exp(scale * q.k), float32. `causal`: top-left causal (training calls it with Sq == Sk).
    Otherwise no mask, with keys at or beyond kv_len[b] hidden (the sampling step; a row with no
    key may hold anything, the caller discards it). `aux` is whatever the backward needs.
    """

    def layout(self, k: torch.Tensor) -> str:
        """Memory order, 'bhsd', 'bshd' or 'sbhd', in which the merge allocates q and dout."""

    def forward(self, q, k, v, *, scale: float, causal: bool, kv_len: torch.Tensor | None = None):
        """-> (out, lse, aux)"""

    def backward(self, dout, q, k, v, out, lse, aux, *, scale: float, causal: bool):
        """-> (dq, dk, dv) for the given out and lse."""


class _AtenFlash:
    """PyTorch's own flash kernels: the CPU one (any float dtype), and on CUDA the bundled
    flash-attention (fp16/bf16), which takes fewer key/value heads than query heads natively."""

    def layout(self, k):
        return "bhsd"

    def forward(self, q, k, v, *, scale, causal, kv_len=None):
        if kv_len is not None:
            raise NotImplementedError("PyTorch's flash kernel path has no key-length mask")
        if q.device.type == "cuda":
            if q.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(
                    f"attention_impl 'fused' on CUDA needs bf16 or fp16 inputs; got {q.dtype} "
                    "(use attention_impl 'sdpa' for fp32)"
                )
            out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = (
                torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            )
            return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, aux, *, scale, causal):
        if aux is not None:
            cum_q, cum_k, max_q, max_k, rng_state, unused = aux
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale
            )
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )


ATEN_FLASH = _AtenFlash()


def _empty(shape: tuple, layout: str, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [B, *heads, S, D] tensor stored in `layout` order ('bshd': tokens before
    heads; 'sbhd': tokens outermost), so a kernel that wants that order gets it without a copy."""
    if layout == "bhsd":
        return like.new_empty(shape)
    b, heads, s, d = shape[0], tuple(shape[1:-2]), shape[-2], shape[-1]
    if layout == "bshd":
        return like.new_empty((b, s, *heads, d)).movedim(1, -2)
    return like.new_empty((s, b, *heads, d)).movedim(0, -2)


def _grouped(x_BHSD: torch.Tensor, num_kv: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, G, g, S, D], a view (splitting a dim never copies)."""
    return x_BHSD.unflatten(1, (num_kv, x_BHSD.shape[1] // num_kv))


def _pack_streams(
    clean: torch.Tensor | None, query: torch.Tensor, last_slot: torch.Tensor | float, layout: str
) -> torch.Tensor:
    """[B, G, S, g, L, ...] kernel input: clean rows (S = 2; None: S = 1, query rows only), then
    query rows rotated by one slot.

    Inputs are grouped [B, G, g, L, ...]; slot r of the query half holds query r+1 and slot L-1
    holds `last_slot`. Keeping a KV group's S*g heads adjacent lets the kernel's GQA mapping
    (head // (S*H/G)) send both streams of a group to the same key/value head.
    """
    streams = 1 if clean is None else 2
    packed = _empty(query.shape[:2] + (streams,) + query.shape[2:], layout, query)
    if clean is not None:
        packed[:, :, 0] = clean
    packed[:, :, -1, :, :-1] = query[:, :, :, 1:]
    packed[:, :, -1, :, -1] = last_slot
    return packed


class _MergedSetCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, row_valid, kernel: PartialAttention):
        length, num_kv = k.shape[2] // 2, k.shape[1]
        first_query = q.shape[2] - length  # L, or 0 when q holds the query rows only
        acc = torch.promote_types(q.dtype, torch.float32)
        layout = kernel.layout(k)
        q_g, k_x, v_x = _grouped(q, num_kv), k[:, :, :length], v[:, :, :length]
        q_m = q_g[..., first_query:, :]
        k_m, v_m = k[:, :, None, length:], v[:, :, None, length:]  # [B, G, 1, L, D]

        q_stack = _pack_streams(q_g[..., :length, :] if first_query else None, q_m, q_m[:, :, :, 0], layout)
        out_s, lse_s, aux = kernel.forward(q_stack.flatten(1, 3), k_x, v_x, scale=scale, causal=True)
        out_s, lse_s = out_s.unflatten(1, q_stack.shape[1:4]), lse_s.unflatten(1, q_stack.shape[1:4])

        # Query 0 sees no clean rank: its output is its own value. Query i >= 1 merges the
        # kernel's slot i-1 (clean ranks < i) with its diagonal score through the log-sum-exp.
        s_diag = (q_m.to(acc) * k_m.to(acc)).sum(-1) * scale  # [B, G, g, L]
        lse_a = lse_s[:, :, -1, :, :-1].to(acc)
        lse_m = torch.cat([s_diag[..., :1], torch.logaddexp(lse_a, s_diag[..., 1:])], dim=-1)
        weight_a = torch.sigmoid(lse_a - s_diag[..., 1:])[..., None]

        out = _empty(q.shape, layout, q)
        out_g = _grouped(out, num_kv)
        if first_query:
            out_g[..., :length, :] = out_s[:, :, 0]
        out_g[..., first_query, :] = v_m[..., 0, :]
        out_g[..., first_query + 1 :, :] = torch.lerp(
            v_m[..., 1:, :].to(acc), out_s[:, :, -1, :, :-1].to(acc), weight_a.to(acc)
        )
        if row_valid is not None:
            out.mul_(row_valid.to(out.dtype))
        # For the backward the kernel gets the MERGED output and lse on the query slots; the
        # discarded slot keeps the kernel's own finite lse so exp(score - lse) stays bounded.
        out_s[:, :, -1, :, :-1] = out_g[..., first_query + 1 :, :]
        lse_s[:, :, -1, :, :-1] = lse_m[..., 1:].to(lse_s.dtype)
        ctx.save_for_backward(q_stack, k, v, out, out_s, lse_s, s_diag, lse_m, row_valid)
        ctx.scale, ctx.kernel, ctx.aux, ctx.layout = scale, kernel, aux, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q_stack, k, v, out, out_s, lse_s, s_diag, lse_m, row_valid = ctx.saved_tensors
        scale = ctx.scale
        length, num_kv = k.shape[2] // 2, k.shape[1]
        first_query = out.shape[2] - length
        acc = lse_m.dtype
        if row_valid is not None:
            dout = dout * row_valid.to(dout.dtype)
        do_g = _grouped(dout, num_kv)
        do_m = do_g[..., first_query:, :]

        # Part A: one kernel backward over both streams. Fed the merged output and lse, it yields
        # the exact restriction of the full softmax gradient to the clean keys.
        do_stack = _pack_streams(do_g[..., :length, :] if first_query else None, do_m, 0.0, ctx.layout)
        dq_s, dk_x, dv_x = ctx.kernel.backward(
            do_stack.flatten(1, 3),
            q_stack.flatten(1, 3),
            k[:, :, :length],
            v[:, :, :length],
            out_s.flatten(1, 3),
            lse_s.flatten(1, 3),
            ctx.aux,
            scale=scale,
            causal=True,
        )
        dq_s = dq_s.unflatten(1, q_stack.shape[1:4])

        # Diagonal: p = softmax weight of each query's own key; dS = p * (dO . (v_self - O)).
        q_m = q_stack[:, :, -1].roll(1, dims=-2).to(acc)
        k_m, v_m = k[:, :, None, length:].to(acc), v[:, :, None, length:].to(acc)
        do_m, out_m = do_m.to(acc), _grouped(out, num_kv)[..., first_query:, :].to(acc)
        p_diag = (s_diag - lse_m).exp()
        ds_diag = p_diag * (do_m * (v_m - out_m)).sum(-1)

        dq = _empty(out.shape, ctx.layout, q_stack)
        dq_g = _grouped(dq, num_kv)
        if first_query:
            dq_g[..., :length, :] = dq_s[:, :, 0]
        dq_g[..., first_query:, :] = scale * ds_diag[..., None] * k_m
        dq_g[..., first_query + 1 :, :] += dq_s[:, :, -1, :, :-1]
        dk = torch.cat([dk_x, torch.einsum("bgnl,bgnld->bgld", scale * ds_diag, q_m).to(k.dtype)], dim=2)
        dv = torch.cat([dv_x, torch.einsum("bgnl,bgnld->bgld", p_diag, do_m).to(v.dtype)], dim=2)
        return dq, dk, dv, None, None, None


def merged_set_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: PartialAttention,
    *,
    scale: float | None = None,
    valid_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set-causal attention (the 'fused' decomposition) on any partial-attention kernel:
    q [B, H, 2L or L, D], k/v [B, G, 2L, D] -> like q."""
    check_qkv(q, k, v, query_rows_only=True)
    length = stream_length(k, valid_len)
    row_valid = None if valid_len is None else valid_row_mask(valid_len, length, q.shape[2] // length)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _MergedSetCausal.apply(q, k, v, scale, row_valid, kernel)
