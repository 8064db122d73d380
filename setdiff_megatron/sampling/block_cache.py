"""The KV cache of the masked-diffusion baselines' decoders (sampling/masked_sampler.py).

A step holds, per row, clean commits (whose K/V join the cache after it) then queries, each
seeing what core/attention.py `grouped_mask` lets it see in training (`begin_step`). It has the
set sampler's KVCache interface (`attend(layer, q, k, v, num_commit=...)`, `advance()`), so both
model bodies (torch, megatron over TP) decode with it unchanged.

Shapes: B rows, H query heads, G key/value heads, T step tokens (Cm commits, Q queries), D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from setdiff_megatron.sampling.kv_cache import CacheSpec

__all__ = ["BlockKVCache"]


class BlockKVCache:
    def __init__(self, spec: CacheSpec, batch_size: int, capacity: int):
        shape = (spec.num_layers, batch_size, spec.num_kv_heads, capacity + 1, spec.head_dim)  # + a scratch slot
        self.keys = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.values = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=spec.device)
        self._mask: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._commits: torch.Tensor | None = None
        self._span = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[3] - 1

    def cat(self, other: BlockKVCache) -> BlockKVCache:
        """These rows, then `other`'s (rows joining a running batch)."""
        out = BlockKVCache.__new__(BlockKVCache)
        out.__dict__.update(self.__dict__)
        out.keys, out.values = torch.cat([self.keys, other.keys], 1), torch.cat([self.values, other.values], 1)
        out.lengths = torch.cat([self.lengths, other.lengths])
        return out

    def select(self, rows: list[int]) -> BlockKVCache:
        """The rows `rows`, in that order (rows retiring from a batch)."""
        out = BlockKVCache.__new__(BlockKVCache)
        out.__dict__.update(self.__dict__)
        index = torch.tensor(rows, device=self.lengths.device)
        out.keys, out.values, out.lengths = self.keys[:, index], self.values[:, index], self.lengths[index]
        return out

    def begin_step(
        self,
        commit_valid: torch.Tensor,
        commit_groups: torch.Tensor,
        query_valid: torch.Tensor,
        query_groups: torch.Tensor | None = None,
    ) -> None:
        """The next step's real slots: commit_valid/commit_groups [B, Cm], query_valid/query_groups
        [B, Q] (query_groups None: one group, every query sees every other); rows pad their commits
        and queries to the step's counts.

        A commit sees the cache and the real commits of its own and earlier groups (BD3-LM's x0
        block-causal rows); a query sees the cache, every real commit and the real queries of its
        own and earlier groups (its block decided together: BD3-LM's noisy block, or MDLM's whole
        window with no cache at all). A BD3-LM window that starts at the prompt's end straddles two
        of the model's blocks, so its queries get two groups, as the reference keeps them
        block-causal (docs/method.md, "The baselines")."""
        b, num_commit = commit_valid.shape
        t = num_commit + query_valid.shape[1]
        span = int(self.lengths.max())
        device = self.lengths.device
        cached = torch.arange(span, device=device)[None, :] < self.lengths[:, None]  # [B, span]
        commit_sees = (commit_groups[:, None, :] <= commit_groups[:, :, None]) & commit_valid[:, None, :]
        rows_commit = torch.cat(
            [commit_sees, torch.zeros(b, num_commit, t - num_commit, dtype=torch.bool, device=device)], 2
        )
        sees_query = query_valid[:, None, :].expand(b, t - num_commit, t - num_commit)
        if query_groups is not None:
            sees_query = sees_query & (query_groups[:, None, :] <= query_groups[:, :, None])
        rows_query = torch.cat([commit_valid[:, None, :].expand(b, t - num_commit, num_commit), sees_query], 2)
        new = torch.cat([rows_commit, rows_query], 1)  # [B, T, T]
        new = new | torch.eye(t, dtype=torch.bool, device=device)  # a padding slot sees itself: no empty row
        self._mask = torch.cat([cached[:, None, :].expand(b, t, span), new], 2)[:, None]  # [B, 1, T, span + T]
        slot = self.lengths[:, None] + commit_valid.long().cumsum(1) - 1
        self._slots = torch.where(commit_valid, slot.clamp(max=self.capacity - 1), self.capacity)
        self._commits = commit_valid.sum(1)
        if bool((self.lengths + self._commits > self.capacity).any()):
            raise ValueError(f"a row's commits overflow the cache of {self.capacity} slots")
        self._span = span

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        num_commit: int,
        commit_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's attention of the step's q [B, H, T, D] over the cache and the step's k/v
        [B, G, T, D]; the real commits' K/V are written behind each row's entries."""
        if self._mask is None or self._slots.shape[1] != num_commit:
            raise RuntimeError("begin_step must describe the step before the model runs it")
        keys = torch.cat([self.keys[layer, :, :, : self._span], k], 2)
        values = torch.cat([self.values[layer, :, :, : self._span], v], 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self._mask, enable_gqa=k.shape[1] != q.shape[1])
        if num_commit:
            index = self._slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self.keys[layer].scatter_(2, index, k[:, :, :num_commit])
            self.values[layer].scatter_(2, index, v[:, :, :num_commit])
        return out

    def advance(self) -> None:
        """After every layer has attended: the commits become cache entries."""
        self.lengths += self._commits
        self._mask = None
