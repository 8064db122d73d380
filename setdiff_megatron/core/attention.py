"""Set-causal attention over the two-stream sequence for training, and the registry of its implementations.

The 2L tokens are [clean stream ; query stream], both in rank order. Clean rank r sees clean ranks
<= r; query rank r sees clean ranks < r and itself, never another query (docs/method.md, "Set-causal
attention"). Every implementation gives the same outputs and gradients: `dense` and `sdpa` (the mask,
materialised) and `fused` here, `te`, `flash_attn` and `auto` from setdiff_megatron/kernels. Padding
rows give zero outputs, and q may hold the query rows only. A sampling step against a KV cache is
core/step_attention.py, not this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from setdiff_megatron.core.attention_shapes import AttentionImpl, check_qkv, stream_length, valid_row_mask
from setdiff_megatron.core.document_attention import document_attention
from setdiff_megatron.core.merged_attention import ATEN_FLASH, merged_set_causal_attention

__all__ = [
    "ATTENTION_IMPLS",
    "ATTENTION_IMPL_NAMES",
    "register_attention_impl",
    "resolve_attention_impl",
    "set_causal_attention",
    "set_causal_mask",
    "grouped_attention",
    "grouped_mask",
]


def set_causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The [2L, 2L] boolean set-causal mask (True = may attend) over ranks."""
    r = torch.arange(length, device=device)
    causal = r[:, None] >= r[None, :]
    clean_rows = torch.cat([causal, torch.zeros_like(causal)], dim=1)
    query_rows = torch.cat([r[:, None] > r[None, :], r[:, None] == r[None, :]], dim=1)
    return torch.cat([clean_rows, query_rows], dim=0)


def grouped_mask(
    groups_BL: torch.Tensor, streams: int = 2, documents_BL: torch.Tensor | None = None, within: str = "group"
) -> torch.Tensor:
    """[B, streams * L, streams * L] boolean mask of set-causal attention over GROUPS of ranks
    (True = may attend): ranks that share a group are decided together, as one set. Clean rank i
    sees the clean ranks of its own and earlier groups; query rank i sees the clean ranks of
    earlier groups and the queries of its own group. With one rank per group this is
    `set_causal_mask`; with the blocks of BD3-LM it is the block-diffusion mask over x0 (+) xt;
    with one stream (queries only) and one group it is MDLM's bidirectional attention. With
    `documents_BL` no rank sees another document's (packed records).

    `within="rank"` is a set sampler's steps instead (a decoded trajectory replayed,
    sampling/trajectory.py): inside a group, clean ranks see the ones before them (commits are causal
    among themselves) and a query sees only itself; across groups as above."""
    g_i, g_j = groups_BL[:, :, None], groups_BL[:, None, :]
    same = g_i == g_j
    if within == "rank":
        rank = torch.arange(groups_BL.shape[1], device=groups_BL.device)
        own = (rank[:, None] == rank[None, :]).expand_as(same)
        clean_see, query_see = rank[:, None] >= rank[None, :], own
    else:
        clean_see, query_see = g_i >= g_j, same
    if streams == 1:
        mask = query_see.expand_as(same)
    else:
        clean_rows = torch.cat([clean_see.expand_as(same), torch.zeros_like(same)], dim=2)
        query_rows = torch.cat([g_i > g_j, query_see.expand_as(same)], dim=2)
        mask = torch.cat([clean_rows, query_rows], dim=1)
    if documents_BL is not None:
        docs = documents_BL.repeat(1, streams)
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    return mask


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    groups: torch.Tensor,
    valid_len: torch.Tensor | None = None,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    within: str = "group",
) -> torch.Tensor:
    """`grouped_mask` attention through SDPA (its memory-efficient kernel on GPUs): k/v hold one
    stream or two ([clean ; query], 2L tokens), q all of their rows or the query rows only; ranks
    at or beyond `valid_len` are padding (zero outputs, hidden as keys). groups (and
    document_ids, which keep packed records apart) [B, L]; `within` as `grouped_mask`."""
    b, _, rows, _ = q.shape
    length = groups.shape[1]
    streams = k.shape[2] // length
    if streams not in (1, 2) or k.shape[2] != streams * length or rows not in (length, streams * length):
        raise ValueError(
            f"groups [B, L={length}] must describe one or two streams of keys ({k.shape[2]} tokens) and "
            f"the rows of q ({rows})"
        )
    allowed = grouped_mask(groups, streams, document_ids, within)[:, -rows:]
    if valid_len is not None:
        real = (torch.arange(length, device=q.device)[None, :] < valid_len[:, None]).repeat(1, streams)
        allowed = torch.where(real[:, -rows:, None], allowed & real[:, None, :], True)  # padding rows: any key
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out if valid_len is None else out * real[:, None, -rows:, None].to(out.dtype)


# --------------------------------------------------------------------------------------------
# dense and sdpa: the mask, materialised


def _dense(q, k, v, scale, valid_len):
    length = stream_length(k, valid_len)
    rows = q.shape[2]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    allowed = set_causal_mask(length, q.device)[None, None, -rows:]  # [1, 1, rows, 2L]
    if valid_len is not None:
        real = valid_row_mask(valid_len, length)[..., 0].bool()  # [B, 1, 2L]
        allowed = allowed & real[..., -rows:, None] & real[..., None, :]
    scores = (q @ k.transpose(-1, -2)) * scale
    # Fully masked (padding) rows would be NaN: give them zero scores, then zero their output.
    has_key = allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~allowed & has_key, float("-inf")).masked_fill(~has_key, 0.0)
    return (scores.softmax(dim=-1) @ v) * has_key


def _sdpa(q, k, v, scale, valid_len):
    length = stream_length(k, valid_len)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=set_causal_mask(length, q.device)[-q.shape[2] :],
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out if valid_len is None else out * valid_row_mask(valid_len, length, q.shape[2] // length).to(out.dtype)


def _fused(q, k, v, scale, valid_len):
    return merged_set_causal_attention(q, k, v, ATEN_FLASH, scale=scale, valid_len=valid_len)


# --------------------------------------------------------------------------------------------
# The registry of training implementations. setdiff_megatron/kernels adds 'auto', 'te' and
# 'flash_attn' when imported (the model bodies import it); core itself imports only torch.

ATTENTION_IMPL_NAMES: tuple[str, ...] = ("auto", "dense", "flash_attn", "fused", "sdpa", "te")
"""Every name `model.attention_impl` takes, sorted: the registry's once the kernels are imported.
A config checks its spelling against this list, whatever has been imported so far
(tests/kernels/test_dispatch.py checks that the registry holds exactly these names)."""
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
        raise ValueError(f"attention_impl must be one of {sorted(ATTENTION_IMPLS)}; got {name!r}") from None
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
    check_qkv(q, k, v, query_rows_only=True)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return document_attention(fn, q, k, v, scale, valid_len, document_ids)
