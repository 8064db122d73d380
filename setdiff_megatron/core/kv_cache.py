"""A preallocated KV cache of committed clean tokens, for the sampler.

Only clean tokens enter the cache; query (MASK) tokens are scored against it and forgotten. A
step's commits are written by each layer as it runs and become visible to later steps once the
model calls `advance` after its last layer, so every layer of one step sees the same cache.

Layout: padded, with per-row lengths. Row b holds its entries in slots [0, lengths[b]), in
commit order. A step appends each row's commits at that row's own length, so a row that commits
fewer tokens than the step's commit slots (the rest are dummies, `commit_valid` False) leaves no
hole: dummies land past its length, masked, and are overwritten later. Attention reads slots
[0, length), `length` being a host-side bound on every row's length (no device sync needed), and
masks each row's unused tail once rows differ. The capacity must also hold one step's tokens
(commits and queries) behind `length`: they are staged there for attention. The sampler admits
rows into a running batch (`with_rows`, `with_capacity`), retires finished ones (`select_rows`)
and drops entries from the middle of rows that outgrow the context (`drop`).

Attention: masked SDPA over the staged slots with a dense step mask (the default), or, when
`attention_impl` names a kernel step (core.step_attention.STEP_IMPLS: 'te', 'flash_attn'), a fused
kernel reading the cache in place with per-row lengths instead of a mask (docs/method.md,
"KV cache").

Shapes: N layers, B batch, G key/value heads, C capacity, D head dim, T step tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from setdiff_megatron.core.step_attention import (
    STEP_IMPLS,
    set_causal_step_attention,
    staged_step_attention,
    step_attention_mask,
)

__all__ = ["KVCache"]


@dataclass
class KVCache:
    keys: torch.Tensor  # [N, B, G, C, D]
    values: torch.Tensor  # [N, B, G, C, D]
    lengths: torch.Tensor  # [B] long: entries held by each row
    length: int = 0
    """Host-side bound: no row has an entry at slot `length` or beyond. Each step raises it by the
    step's commit slots; a caller that knows lengths.max() (the sampler) may lower it."""
    ragged: bool = False
    """Set once rows may differ in length; until then attention needs no key mask."""
    attention_impl: str = "sdpa"
    """Step attention: a name with a kernel step in core.step_attention.STEP_IMPLS ('te', 'flash_attn')
    runs that kernel over the cache with per-row lengths; any other name, masked SDPA. Models
    pass their attention_impl, 'auto' resolved for their device and dtype."""
    _step: tuple | None = field(default=None, repr=False)
    """(attention mask or None on the kernel path, commit slots of ragged rows, commit counts) of
    the step in flight: computed by layer 0, shared by the other layers, consumed by `advance`."""

    @classmethod
    def allocate(cls, *, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype = torch.float32, device=None,
                 attention_impl: str = "sdpa") -> "KVCache":
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        return cls(
            keys=torch.zeros(shape, dtype=dtype, device=device),
            values=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
            attention_impl=attention_impl,
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def uses_kernel(self) -> bool:
        """Whether attention runs a kernel step (lengths, no dense mask) rather than masked SDPA."""
        return self.attention_impl in STEP_IMPLS

    def _plan_step(self, batch_size: int, num_commit: int, num_tokens: int,
                   commit_valid: torch.Tensor | None) -> tuple:
        device, key_mask, slots = self.lengths.device, None, None
        counts = None if commit_valid is None else commit_valid.sum(1)
        if self.ragged:
            slots = self.lengths[:, None] + torch.arange(num_commit, device=device)
        if self.uses_kernel:  # the kernel takes lengths (self.lengths, counts): no dense mask
            return None, slots, counts
        if self.ragged:
            key_mask = torch.arange(self.length, device=device) < self.lengths[:, None]
        mask = step_attention_mask(batch_size, num_commit, num_tokens - num_commit, self.length,
                                   cache_mask=key_mask, commit_mask=commit_valid, device=device)
        return mask, slots, counts

    def attend(self, layer: int, q_BHTD: torch.Tensor, k_BGTD: torch.Tensor, v_BGTD: torch.Tensor, *,
               num_commit: int, commit_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer's step tokens; appends the commits' K/V to each row.

        The step's T tokens are staged in slots [length, length + T), behind every row's entries,
        so attention reads the cache in place rather than a per-layer copy of it; then, where rows
        differ in length, the valid commits (a prefix of each row) move to the row's own end. On
        the kernel path the cache part is slots [0, length) with each row's real entries a prefix
        of lengths[b] (once ragged), and the staged commits a prefix of commit_valid's counts.
        """
        start, num_tokens = self.length, k_BGTD.shape[2]
        if start + num_tokens > self.capacity:
            raise ValueError(
                f"KV cache capacity {self.capacity} exceeded ({start} cached + {num_tokens} step tokens); "
                "allocate a larger capacity"
            )
        if layer == 0:
            self._step = self._plan_step(q_BHTD.shape[0], num_commit, num_tokens, commit_valid)
        mask, slots, counts = self._step
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, start:start + num_tokens] = k_BGTD
        values[:, :, start:start + num_tokens] = v_BGTD
        if mask is None:
            out = set_causal_step_attention(
                q_BHTD, keys[:, :, start:start + num_tokens], values[:, :, start:start + num_tokens],
                keys[:, :, :start], values[:, :, :start], num_commit=num_commit, impl=self.attention_impl,
                cache_len=self.lengths if self.ragged else None, commit_len=counts)
        else:
            out = staged_step_attention(q_BHTD, keys[:, :, :start + num_tokens], values[:, :, :start + num_tokens],
                                        mask)
        if slots is not None:
            index = slots[:, None, :, None].expand(-1, k_BGTD.shape[1], -1, k_BGTD.shape[3])
            keys.scatter_(2, index, k_BGTD[:, :, :num_commit])
            values.scatter_(2, index, v_BGTD[:, :, :num_commit])
        return out

    def advance(self, num_commit: int, *, partial: bool = False) -> None:
        """Make this step's commits visible; `partial` says some rows' commits were dummies."""
        self.lengths += self._step[2] if partial else num_commit
        self.length += num_commit
        self.ragged = self.ragged or partial
        self._step = None

    def select_rows(self, index: torch.Tensor) -> "KVCache":
        """A cache holding only the rows `index` (a copy): how the sampler retires finished rows."""
        return KVCache(keys=self.keys[:, index], values=self.values[:, index], lengths=self.lengths[index],
                       length=self.length, ragged=self.ragged, attention_impl=self.attention_impl)

    def with_rows(self, count: int) -> "KVCache":
        """This cache plus `count` empty rows at the end (a copy): how rows join a running batch."""
        def grow(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(t.shape[0], count, *t.shape[2:])], 1)

        return KVCache(keys=grow(self.keys), values=grow(self.values),
                       lengths=torch.cat([self.lengths, self.lengths.new_zeros(count)]), length=self.length,
                       ragged=self.ragged or (count > 0 and self.length > 0), attention_impl=self.attention_impl)

    def with_capacity(self, capacity: int) -> "KVCache":
        """This cache with at least `capacity` slots per row (a copy when it must grow)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return self

        def grow(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(*t.shape[:3], extra, t.shape[4])], 3)

        return KVCache(keys=grow(self.keys), values=grow(self.values), lengths=self.lengths, length=self.length,
                       ragged=self.ragged, attention_impl=self.attention_impl)

    def drop(self, start_B: torch.Tensor, count_B: torch.Tensor) -> None:
        """Remove entries [start, start + count) of each row, shifting its later entries left.

        One gather over the whole cache; the sampler calls it rarely (it drops in chunks).
        """
        slot = torch.arange(self.capacity, device=self.lengths.device)
        source_BC = slot + torch.where(slot >= start_B[:, None], count_B[:, None], 0)
        index = source_BC.clamp(max=self.capacity - 1)[None, :, None, :, None].expand_as(self.keys)
        self.keys = self.keys.gather(3, index)
        self.values = self.values.gather(3, index)
        self.lengths = self.lengths - count_B
        self.ragged = True
