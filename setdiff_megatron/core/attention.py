"""Set-causal attention over the two-stream sequence, for training and for one sampling step.

The 2L tokens are [clean stream ; query stream], both in rank order (the sampled order). The
rule of ALGORITHM.md 1.4: clean rank r sees clean ranks <= r; query rank r sees clean ranks < r
and itself, never another query. Three training implementations, selected by name, give the
same outputs and gradients:

  dense  a boolean 2L x 2L mask and an explicit softmax; the readable reference (tests only)
  sdpa   the same mask through F.scaled_dot_product_attention
  fused  KERNELS.md 3: ONE causal kernel call serves both streams. The query rows are rotated by
         one slot (slot r holds query r+1, so plain causal attention gives it clean ranks <= r,
         i.e. < r+1) and stacked as extra heads next to the clean heads of the same KV group.
         Each query's own key (the diagonal) is merged in through the log-sum-exp. The backward
         calls the kernel backward once with the merged output and log-sum-exp, the way ring
         attention does, and adds the diagonal gradient analytically. The merge takes any
         `PartialAttention` kernel: here PyTorch's flash kernels; setdiff_megatron/kernels adds
         Transformer Engine's and flash-attn's low-level calls ('te', 'flash_attn') and 'auto'.

Padding: `valid_len[b]` ranks are real in each stream; ranks at or beyond it are padding, whose
outputs are defined as zero (the order policies put padding last, so no real row sees them).

Documents: with `document_ids` [B, L] (rank order) row i attends key j only where the rule allows
it AND both are in the same document (packed training windows). Every implementation is exact
under it through one regrouping: within a document the relative rank order is kept, so the
masked attention equals plain set-causal attention of each document's own ranks, taken as a
sub-sequence of a padded batch (`document_attention`).

Query rows only: q may hold just the query stream (L rows against the 2L keys). The model's last
layer asks for that, since nothing reads its clean-stream outputs; every implementation then
skips the clean rows' attention (the fused one calls the kernel with H heads instead of 2H).

Shapes: B batch, H query heads, G key/value heads (GQA: H % G == 0), L ranks per stream,
T tokens in a sampling step, C cached tokens, D head dim.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_IMPLS",
    "PartialAttention",
    "document_attention",
    "merged_set_causal_attention",
    "merged_step_attention",
    "register_attention_impl",
    "register_step_impl",
    "resolve_attention_impl",
    "set_causal_mask",
    "set_causal_attention",
    "step_mask",
    "set_causal_step_attention",
    "staged_step_attention",
    "step_attention_mask",
]


def set_causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The [2L, 2L] boolean set-causal mask (True = may attend) over ranks."""
    r = torch.arange(length, device=device)
    causal = r[:, None] >= r[None, :]
    clean_rows = torch.cat([causal, torch.zeros_like(causal)], dim=1)
    query_rows = torch.cat([r[:, None] > r[None, :], r[:, None] == r[None, :]], dim=1)
    return torch.cat([clean_rows, query_rows], dim=0)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_rows_only: bool = False) -> None:
    """Shapes of q/k/v; with `query_rows_only` q may also hold half of k's tokens."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [batch, heads, tokens, head_dim]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    rows_ok = q.shape[2] == k.shape[2] or (query_rows_only and 2 * q.shape[2] == k.shape[2])
    if q.shape[0] != k.shape[0] or not rows_ok or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, tokens and head_dim"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )


def _row_valid(valid_len: torch.Tensor, length: int, streams: int = 2) -> torch.Tensor:
    """[B, 1, streams * L, 1] float mask of real rows in both streams (or the query stream)."""
    ranks = torch.arange(length, device=valid_len.device)
    valid_BL = ranks[None, :] < valid_len[:, None]
    return valid_BL.repeat(1, streams)[:, None, :, None]


def _split_length(k: torch.Tensor, valid_len: torch.Tensor | None) -> int:
    """L, from the keys (always both streams)."""
    two_l = k.shape[2]
    if two_l < 2 or two_l % 2:
        raise ValueError(
            f"the token axis must hold two streams of L >= 1 ranks (2L tokens); got {two_l}"
        )
    length = two_l // 2
    if valid_len is not None:
        if valid_len.shape != (k.shape[0],):
            raise ValueError(f"valid_len must have shape [batch]={k.shape[0]}; got {tuple(valid_len.shape)}")
        if bool((valid_len < 0).any()) or bool((valid_len > length).any()):
            raise ValueError(f"valid_len must lie in [0, L={length}]")
    return length


# --------------------------------------------------------------------------------------------
# dense and sdpa: the mask, materialised


def _dense(q, k, v, scale, valid_len):
    length = _split_length(k, valid_len)
    rows = q.shape[2]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    allowed = set_causal_mask(length, q.device)[None, None, -rows:]  # [1, 1, rows, 2L]
    if valid_len is not None:
        real = _row_valid(valid_len, length)[..., 0].bool()  # [B, 1, 2L]
        allowed = allowed & real[..., -rows:, None] & real[..., None, :]
    scores = (q @ k.transpose(-1, -2)) * scale
    # Fully masked (padding) rows would be NaN: give them zero scores, then zero their output.
    has_key = allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~allowed & has_key, float("-inf")).masked_fill(~has_key, 0.0)
    return (scores.softmax(dim=-1) @ v) * has_key


def _sdpa(q, k, v, scale, valid_len):
    length = _split_length(k, valid_len)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=set_causal_mask(length, q.device)[-q.shape[2]:], scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out if valid_len is None else out * _row_valid(valid_len, length, q.shape[2] // length).to(out.dtype)


# --------------------------------------------------------------------------------------------
# fused: one causal kernel call, rotated query heads, log-sum-exp merge of the diagonal.
# The merge runs over any "partial attention" kernel: PyTorch's flash kernels here, Transformer
# Engine's and flash-attn's low-level calls in setdiff_megatron/kernels/.


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
                raise ValueError(f"attention_impl 'fused' on CUDA needs bf16 or fp16 inputs; got {q.dtype} "
                                 "(use attention_impl 'sdpa' for fp32)")
            out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = (
                torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale))
            return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, aux, *, scale, causal):
        if aux is not None:
            cum_q, cum_k, max_q, max_k, rng_state, unused = aux
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)


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


def _pack_streams(clean: torch.Tensor | None, query: torch.Tensor, last_slot: torch.Tensor | float,
                  layout: str) -> torch.Tensor:
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
        out_g[..., first_query + 1:, :] = torch.lerp(
            v_m[..., 1:, :].to(acc), out_s[:, :, -1, :, :-1].to(acc), weight_a.to(acc)
        )
        if row_valid is not None:
            out.mul_(row_valid.to(out.dtype))
        # For the backward the kernel gets the MERGED output and lse on the query slots; the
        # discarded slot keeps the kernel's own finite lse so exp(score - lse) stays bounded.
        out_s[:, :, -1, :, :-1] = out_g[..., first_query + 1:, :]
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
            do_stack.flatten(1, 3), q_stack.flatten(1, 3), k[:, :, :length], v[:, :, :length],
            out_s.flatten(1, 3), lse_s.flatten(1, 3), ctx.aux, scale=scale, causal=True,
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
        dq_g[..., first_query + 1:, :] += dq_s[:, :, -1, :, :-1]
        dk = torch.cat([dk_x, torch.einsum("bgnl,bgnld->bgld", scale * ds_diag, q_m).to(k.dtype)], dim=2)
        dv = torch.cat([dv_x, torch.einsum("bgnl,bgnld->bgld", p_diag, do_m).to(v.dtype)], dim=2)
        return dq, dk, dv, None, None, None


def merged_set_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: PartialAttention, *,
                                scale: float | None = None, valid_len: torch.Tensor | None = None) -> torch.Tensor:
    """Set-causal attention (the 'fused' decomposition) on any partial-attention kernel:
    q [B, H, 2L or L, D], k/v [B, G, 2L, D] -> like q."""
    _check_qkv(q, k, v, query_rows_only=True)
    length = _split_length(k, valid_len)
    row_valid = None if valid_len is None else _row_valid(valid_len, length, q.shape[2] // length)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _MergedSetCausal.apply(q, k, v, scale, row_valid, kernel)


def _fused(q, k, v, scale, valid_len):
    return merged_set_causal_attention(q, k, v, ATEN_FLASH, scale=scale, valid_len=valid_len)


# --------------------------------------------------------------------------------------------
# The registry of training implementations. setdiff_megatron/kernels adds 'auto', 'te' and
# 'flash_attn' when imported (models/config.py imports it); core itself imports only torch.

AttentionImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]

ATTENTION_IMPLS: dict[str, AttentionImpl] = {"dense": _dense, "sdpa": _sdpa, "fused": _fused}
_IMPL_CHECKS: dict[str, Callable[[], None]] = {}


def register_attention_impl(name: str, fn: AttentionImpl, *, check: Callable[[], None] | None = None) -> None:
    """Add a training implementation; `check` raises if it cannot run on this machine and is
    called whenever the name is resolved (keep it cheap: cache what it probes)."""
    ATTENTION_IMPLS[name] = fn
    if check is not None:
        _IMPL_CHECKS[name] = check


def resolve_attention_impl(name: str) -> AttentionImpl:
    """Resolve an implementation name once (models call this at construction)."""
    try:
        fn = ATTENTION_IMPLS[name]
    except KeyError:
        raise ValueError(
            f"attention_impl must be one of {sorted(ATTENTION_IMPLS)}; got {name!r}"
        ) from None
    if name in _IMPL_CHECKS:
        _IMPL_CHECKS[name]()
    return fn


def set_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    impl: str = "fused",
    valid_len: torch.Tensor | None = None,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set-causal attention. q [B, H, 2L, D] (or [B, H, L, D]: the query rows only), k/v
    [B, G, 2L, D] -> like q; with `document_ids` [B, L] no row attends across documents."""
    fn = resolve_attention_impl(impl)
    _check_qkv(q, k, v, query_rows_only=True)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return document_attention(fn, q, k, v, scale, valid_len, document_ids)


# --------------------------------------------------------------------------------------------
# Documents: each (row, document) becomes one sub-sequence of a padded batch


def document_attention(fn: AttentionImpl, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       valid_len: torch.Tensor | None, document_ids: torch.Tensor | None) -> torch.Tensor:
    """`fn` restricted to each document (`fn` itself without document ids).

    Each (row, document)'s ranks, in rank order, fill one sub-sequence of a batch padded to the
    longest document; padding ranks of a row form a group of their own with no real rank, so
    their outputs stay zero. `fn` runs once on that batch and the outputs go back through
    differentiable gathers, so outputs and gradients are `fn`'s own. Costs: host syncs for the
    sub-batch's shape, and the sub-batch holds (documents x longest document) ranks per stream,
    up to documents times the window's when one long document shares it with short ones.
    """
    if document_ids is None:
        return fn(q, k, v, scale, valid_len)
    length = _split_length(k, valid_len)
    if document_ids.shape != (k.shape[0], length):
        raise ValueError(f"document_ids must have shape [batch, L]=[{k.shape[0]}, {length}]; "
                         f"got {tuple(document_ids.shape)}")
    dest, sub_valid, width = _document_slots(document_ids, valid_len)
    num_groups = sub_valid.shape[0]
    out = fn(*(_to_documents(x, dest, num_groups, width) for x in (q, k, v)), scale, sub_valid)
    return _from_documents(out, dest, q.shape[0], width)


def _document_slots(document_ids: torch.Tensor, valid_len: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(dest [B*L]: each (row, rank)'s index in the [groups * width] sub-sequence slots,
    real ranks per group [groups], width = the largest group).

    A group is a (row, document) pair, padding ranks of a row a group apart; a rank's slot in
    its group is the number of the group's ranks before it, which keeps the rank order.
    """
    b, length = document_ids.shape
    ids = document_ids.long()
    ranks = torch.arange(length, device=ids.device)
    real = torch.ones_like(ids, dtype=torch.bool) if valid_len is None else ranks < valid_len[:, None]
    ids = torch.where(real, ids - ids.min() + 1, 0)  # 0: padding
    rows = torch.arange(b, device=ids.device)[:, None]
    _, group, sizes = torch.unique((rows * (int(ids.max()) + 1) + ids).flatten(), return_inverse=True,
                                   return_counts=True)
    order = group.argsort(stable=True)  # by group, then by row-major index: by rank within a group
    slot = torch.empty_like(order)
    slot[order] = torch.arange(b * length, device=ids.device) - (sizes.cumsum(0) - sizes)[group[order]]
    width = int(sizes.max())
    sub_valid = torch.zeros_like(sizes).index_add_(0, group, real.flatten().long())
    return group * width + slot, sub_valid, width


def _to_documents(x: torch.Tensor, dest: torch.Tensor, num_groups: int, width: int) -> torch.Tensor:
    """[B, H, S*L, D] (S = 2 streams, or 1: the query rows) -> [groups, H, S*width, D], each
    stream's ranks in their slots, empty slots zero."""
    b, h, rows, d = x.shape
    streams = rows // (dest.shape[0] // b)
    ranks = x.unflatten(2, (streams, -1)).movedim(3, 1).flatten(0, 1)  # [B*L, H, S, D]
    slots = ranks.new_zeros(num_groups * width, h, streams, d).index_copy(0, dest, ranks)
    return slots.unflatten(0, (num_groups, width)).movedim(1, 3).flatten(2, 3)


def _from_documents(y: torch.Tensor, dest: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[groups, H, S*width, D] -> [B, H, S*L, D]: `_to_documents` undone on the occupied slots."""
    _, h, rows, d = y.shape
    slots = y.unflatten(2, (rows // width, width)).movedim(3, 1).flatten(0, 1)  # [groups*width, H, S, D]
    return slots.index_select(0, dest).unflatten(0, (batch, -1)).movedim(1, 3).flatten(2, 3)


# --------------------------------------------------------------------------------------------
# One sampling step with a KV cache (KERNELS.md 4)


def step_mask(num_commit: int, num_query: int, num_cached: int, key_valid: torch.Tensor | None = None,
              device=None) -> torch.Tensor:
    """[B or 1, 1, T, C+T] mask of a step: T = num_commit new clean tokens then num_query queries.

    Commit row a sees the cache and commits 0..a (bottom-right causal); a query row sees the cache,
    every commit and itself. `key_valid` [B, C + num_commit] hides cache holes and dummy commits
    of rows that commit fewer tokens. Every row sees at least itself, so no row is empty.
    """
    t = num_commit + num_query
    i = torch.arange(t, device=device)
    commit_col = i[None, :] < num_commit
    new_cols = (commit_col & ((i[None, :] <= i[:, None]) | (i[:, None] >= num_commit))) | (i[None, :] == i[:, None])
    mask = torch.cat([torch.ones(t, num_cached, dtype=torch.bool, device=device), new_cols], dim=1)[None, None]
    if key_valid is not None:
        valid = torch.cat([key_valid, key_valid.new_ones(key_valid.shape[0], num_query)], dim=1)
        own_key = torch.arange(num_cached + t, device=device)[None, :] == (i[:, None] + num_cached)
        mask = mask & (valid[:, None, None, :] | own_key)
    return mask


def step_attention_mask(batch_size: int, num_commit: int, num_query: int, num_cached: int, *,
                        cache_mask: torch.Tensor | None = None, commit_mask: torch.Tensor | None = None,
                        device=None) -> torch.Tensor:
    """`step_mask` from per-row masks of real entries: cache_mask [B, C] and commit_mask
    [B, num_commit] (False = a hole, or a dummy commit of a row that commits fewer tokens)."""
    for name, m, n in (("cache_mask", cache_mask, num_cached), ("commit_mask", commit_mask, num_commit)):
        if m is not None and m.shape != (batch_size, n):
            raise ValueError(f"{name} must have shape ({batch_size}, {n}); got {tuple(m.shape)}")
    key_valid = None
    if cache_mask is not None or commit_mask is not None:
        ones = partial(torch.ones, dtype=torch.bool, device=device)
        key_valid = torch.cat([
            cache_mask if cache_mask is not None else ones(batch_size, num_cached),
            commit_mask if commit_mask is not None else ones(batch_size, num_commit),
        ], dim=1)
    return step_mask(num_commit, num_query, num_cached, key_valid, device)


def staged_step_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """One step's attention with its K/V staged behind the cache: keys/values [B, G, C + T, D].

    A KV cache passes views of its own storage, so no layer copies the cache; `mask` comes from
    `step_attention_mask`, built once per step.
    """
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        enable_gqa=keys.shape[1] != q.shape[1],
    )


def merged_step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, kernel: PartialAttention, *, num_commit: int,
                          cache_len: torch.Tensor | None = None, commit_len: torch.Tensor | None = None,
                          scale: float | None = None) -> torch.Tensor:
    """One sampling step on a partial-attention kernel, exact against `step_mask`; forward only.

    KERNELS.md 4, single pass over the cache: (1) every step row attends the cache in ONE kernel
    call with no mask (keys at or beyond cache_len[b] hidden), so the cache is read once; (2) the
    step block, rows [commits; queries] against the commits: commit a sees commits <= a (with (1),
    bottom-right causal over [cache; commits]), a query sees every commit; commits at or beyond
    commit_len[b] are hidden except from their own row; (3) each query's own key. (2) and (3) are
    T x (N + 1) scores, computed directly; (4) the parts merge through their log-sum-exps. Real
    cache entries and commits must be a prefix of each row (what KVCache keeps).
    """
    t, n, c = q.shape[2], num_commit, k_cache.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[1] // k.shape[1]
    q_a = q.to(acc)
    k_h, v_h = (x.repeat_interleave(groups, dim=1).to(acc) for x in (k, v))  # the T step tokens only
    i = torch.arange(t, device=q.device)
    j = i[:n]
    sees = (j[None, :] <= i[:, None]) | (i[:, None] >= n)  # [T, N]
    if commit_len is not None:
        sees = sees & ((j[None, :] < commit_len[:, None])[:, None, None, :] | (j[None, :] == i[:, None]))
    scores = torch.cat([
        (q_a @ k_h[:, :, :n].transpose(-1, -2) * scale).masked_fill(~sees, float("-inf")),
        ((q_a * k_h).sum(-1) * scale).masked_fill(i < n, float("-inf"))[..., None],
    ], dim=-1)
    lse = scores.logsumexp(-1)  # finite: every row sees its own key
    p = (scores - lse[..., None]).exp()
    out = p[..., :n] @ v_h[:, :, :n] + p[..., n:] * v_h
    if c > 0:
        out_c, lse_c, _ = kernel.forward(q, k_cache, v_cache, scale=scale, causal=False, kv_len=cache_len)
        out_c, lse_c = out_c.to(acc), lse_c.to(acc)
        if cache_len is not None:  # a row without cache entries: whatever the kernel wrote is void
            empty = (cache_len == 0)[:, None, None]
            lse_c = lse_c.masked_fill(empty, float("-inf"))
            out_c = out_c.masked_fill(empty[..., None], 0.0)
        lse_all = torch.logaddexp(lse_c, lse)
        out = (lse_c - lse_all).exp()[..., None] * out_c + (lse - lse_all).exp()[..., None] * out
    return out.to(q.dtype)


StepImpl = Callable[..., torch.Tensor]
"""(q, k, v, k_cache, v_cache, *, num_commit, cache_len, commit_len, scale) -> out"""

STEP_IMPLS: dict[str, StepImpl] = {}
"""Kernel-backed step attention by implementation name (setdiff_megatron/kernels registers them);
names without an entry take the masked SDPA step."""


def register_step_impl(name: str, fn: StepImpl) -> None:
    STEP_IMPLS[name] = fn


def _prefix_len(mask: torch.Tensor, name: str) -> torch.Tensor:
    """Lengths of a [B, N] mask whose True entries form a prefix of each row."""
    length = mask.sum(1)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < length[:, None]):
        raise ValueError(f"{name}: kernel step attention needs each row's real entries to be a prefix")
    return length


def set_causal_step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_commit: int,
    cache_mask: torch.Tensor | None = None,
    commit_mask: torch.Tensor | None = None,
    scale: float | None = None,
    impl: str = "sdpa",
    cache_len: torch.Tensor | None = None,
    commit_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sampling step, exact against the training rule.

    q [B, H, T, D], k/v [B, G, T, D]: the first `num_commit` of the T tokens are clean tokens being
    committed (their K/V join the cache afterwards); the rest are MASK queries, each scored as the
    next rank after every committed token. k_cache/v_cache [B, G, C, D] hold committed tokens.
    cache_mask [B, C] and commit_mask [B, num_commit] mark real entries (False = a hole, or a
    dummy commit of a row that commits fewer tokens this step); cache_len/commit_len [B] say the
    same for prefixes. `impl`: a training implementation name; those with a kernel step ('te',
    'flash_attn', 'auto' once setdiff_megatron.kernels is imported) run `merged_step_attention`
    (prefix masks only), the others masked SDPA.
    """
    _check_qkv(q, k, v)
    t = q.shape[2]
    if not 0 <= num_commit <= t:
        raise ValueError(f"num_commit must lie in [0, {t}] (the tokens of the step); got {num_commit}")
    if k_cache.shape != v_cache.shape or k_cache.shape[:2] != k.shape[:2] or k_cache.shape[3] != k.shape[3]:
        raise ValueError(
            f"k_cache/v_cache must be [B, G, C, D] matching k {tuple(k.shape)}; got {tuple(k_cache.shape)}"
        )
    if impl not in ATTENTION_IMPLS:
        resolve_attention_impl(impl)  # raises the usual error
    if impl in STEP_IMPLS:
        if cache_mask is not None and cache_len is None:
            cache_len = _prefix_len(cache_mask, "cache_mask")
        if commit_mask is not None and commit_len is None:
            commit_len = _prefix_len(commit_mask, "commit_mask")
        return STEP_IMPLS[impl](q, k, v, k_cache, v_cache, num_commit=num_commit, cache_len=cache_len,
                                commit_len=commit_len, scale=scale)
    if cache_len is not None and cache_mask is None:
        cache_mask = torch.arange(k_cache.shape[2], device=q.device) < cache_len[:, None]
    if commit_len is not None and commit_mask is None:
        commit_mask = torch.arange(num_commit, device=q.device) < commit_len[:, None]
    mask = step_attention_mask(q.shape[0], num_commit, t - num_commit, k_cache.shape[2], cache_mask=cache_mask,
                               commit_mask=commit_mask, device=q.device)
    return staged_step_attention(q, torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2), mask, scale)
