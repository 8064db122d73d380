"""Attention of one sampling step with a KV cache, exact against the training rule
(docs/method.md, "KV cache").

A step holds T tokens: clean tokens being committed (their K/V join the cache afterwards), then
MASK queries, each scored as the next rank after every committed token. Two paths: the step mask
(`step_mask`) through SDPA over K/V staged behind the cache, or, for implementations that register
a kernel step (setdiff_megatron/kernels: 'te', 'flash_attn', 'auto'), `merged_step_attention` on a
partial-attention kernel that reads the cache in place with per-row lengths instead of a mask.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from setdiff_megatron.core.attention import ATTENTION_IMPLS, resolve_attention_impl
from setdiff_megatron.core.attention_shapes import check_qkv
from setdiff_megatron.core.merged_attention import PartialAttention

__all__ = [
    "STEP_IMPLS",
    "TOKEN_MAJOR_CACHE",
    "merged_step_attention",
    "register_step_impl",
    "set_causal_step_attention",
    "staged_step_attention",
    "step_attention_mask",
    "step_mask",
]


def step_mask(
    num_commit: int, num_query: int, num_cached: int, key_valid: torch.Tensor | None = None, device=None
) -> torch.Tensor:
    """[B or 1, 1, T, C+T] mask of a step: T = num_commit new clean tokens then num_query queries.

    Commit row a sees the cache and commits 0..a (bottom-right causal); a query row sees the cache,
    every commit and itself. `key_valid` [B, C + num_commit] hides cache holes and dummy commits
    of rows that commit fewer tokens. Every row sees at least itself, so no row is empty.
    """
    t = num_commit + num_query
    if key_valid is None and not torch.compiler.is_compiling():  # eager decode: a few ops a step
        block = _step_block(num_commit, num_query, torch.device(device or "cpu"))
        return torch.cat([block.new_ones(t, num_cached), block], dim=1)[None, None]
    mask = torch.cat([torch.ones(t, num_cached, dtype=torch.bool, device=device), _new_cols(num_commit, t, device)], 1)
    mask = mask[None, None]
    if key_valid is not None:
        i = torch.arange(t, device=device)
        valid = torch.cat([key_valid, key_valid.new_ones(key_valid.shape[0], num_query)], dim=1)
        own_key = torch.arange(num_cached + t, device=device)[None, :] == (i[:, None] + num_cached)
        mask = mask & (valid[:, None, None, :] | own_key)
    return mask


def _new_cols(num_commit: int, t: int, device) -> torch.Tensor:
    """[T, T]: which of the step's own tokens each step token sees."""
    i = torch.arange(t, device=device)
    commit_col = i[None, :] < num_commit
    return (commit_col & ((i[None, :] <= i[:, None]) | (i[:, None] >= num_commit))) | (i[None, :] == i[:, None])


@functools.lru_cache(maxsize=64)
def _step_block(num_commit: int, num_query: int, device: torch.device) -> torch.Tensor:
    """`_new_cols` kept per step shape: it depends on nothing else."""
    return _new_cols(num_commit, num_commit + num_query, device)


def step_attention_mask(
    batch_size: int,
    num_commit: int,
    num_query: int,
    num_cached: int,
    *,
    cache_mask: torch.Tensor | None = None,
    commit_mask: torch.Tensor | None = None,
    device=None,
) -> torch.Tensor:
    """`step_mask` from per-row masks of real entries: cache_mask [B, C] and commit_mask
    [B, num_commit] (False = a hole, or a dummy commit of a row that commits fewer tokens)."""
    for name, m, n in (("cache_mask", cache_mask, num_cached), ("commit_mask", commit_mask, num_commit)):
        if m is not None and m.shape != (batch_size, n):
            raise ValueError(f"{name} must have shape ({batch_size}, {n}); got {tuple(m.shape)}")
    key_valid = None
    if cache_mask is not None or commit_mask is not None:
        ones = partial(torch.ones, dtype=torch.bool, device=device)
        key_valid = torch.cat(
            [
                cache_mask if cache_mask is not None else ones(batch_size, num_cached),
                commit_mask if commit_mask is not None else ones(batch_size, num_commit),
            ],
            dim=1,
        )
    return step_mask(num_commit, num_query, num_cached, key_valid, device)


def staged_step_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """One step's attention with its K/V staged behind the cache: keys/values [B, G, C + T, D].

    A KV cache passes views of its own storage, so no layer copies the cache; `mask` comes from
    `step_attention_mask`, built once per step.
    """
    return F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=mask,
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        enable_gqa=keys.shape[1] != q.shape[1],
    )


def merged_step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kernel: PartialAttention,
    *,
    num_commit: int,
    cache_len: torch.Tensor | None = None,
    commit_len: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """One sampling step on a partial-attention kernel, exact against `step_mask`; forward only.

    Single pass over the cache (docs/method.md, "KV cache"): (1) every step row attends the
    cache in ONE kernel call with no mask (keys at or beyond cache_len[b] hidden), so the cache is
    read once; (2) the step block, rows [commits; queries] against the commits: commit a sees commits <= a (with (1),
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
    scores = torch.cat(
        [
            (q_a @ k_h[:, :, :n].transpose(-1, -2) * scale).masked_fill(~sees, float("-inf")),
            ((q_a * k_h).sum(-1) * scale).masked_fill(i < n, float("-inf"))[..., None],
        ],
        dim=-1,
    )
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
TOKEN_MAJOR_CACHE: set[str] = set()
"""Kernel steps that read the cache only as tokens-before-heads storage ([b, s, h, d] contiguous,
Transformer Engine's bshd): a KV cache for them is stored that way, so no step copies it."""


def register_step_impl(name: str, fn: StepImpl, *, token_major_cache: bool = False) -> None:
    STEP_IMPLS[name] = fn
    if token_major_cache:
        TOKEN_MAJOR_CACHE.add(name)


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
    check_qkv(q, k, v)
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
        return STEP_IMPLS[impl](
            q, k, v, k_cache, v_cache, num_commit=num_commit, cache_len=cache_len, commit_len=commit_len, scale=scale
        )
    if cache_len is not None and cache_mask is None:
        cache_mask = torch.arange(k_cache.shape[2], device=q.device) < cache_len[:, None]
    if commit_len is not None and commit_mask is None:
        commit_mask = torch.arange(num_commit, device=q.device) < commit_len[:, None]
    mask = step_attention_mask(
        q.shape[0],
        num_commit,
        t - num_commit,
        k_cache.shape[2],
        cache_mask=cache_mask,
        commit_mask=commit_mask,
        device=q.device,
    )
    return staged_step_attention(q, torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2), mask, scale)
