"""A preallocated KV cache of committed clean tokens, for the sampler (docs/method.md, "KV cache").

Only clean tokens enter the cache; query (MASK) tokens are scored against it and forgotten. Row b
holds its entries in slots [0, lengths[b]), in commit order. A step's commits become visible only
when the model calls `advance` after its last layer, so every layer of one step sees the same cache.
One extra slot per row, past `capacity`, takes the writes of dummy commits, so no dummy lands in a
row's entries. The attention rule itself is core/step_attention.py's.

Shapes: N layers, B batch, G key/value heads, C capacity, D head dim, T step tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from setdiff_megatron.core.step_attention import (
    STEP_IMPLS,
    TOKEN_MAJOR_CACHE,
    set_causal_step_attention,
    staged_step_attention,
    step_attention_mask,
)
from setdiff_megatron.sampling.step_layout import StepLayout

__all__ = ["CacheSpec", "KVCache"]


def _token_major(t_NBGCD: torch.Tensor) -> torch.Tensor:
    """The same values stored [N, B, C, G, D] (a copy only when they are not already)."""
    if t_NBGCD.transpose(2, 3).is_contiguous():
        return t_NBGCD
    return t_NBGCD.transpose(2, 3).contiguous().transpose(2, 3)


@dataclass(frozen=True)
class CacheSpec:
    """The shape of a model body's KV cache on this rank (its local key/value heads under TP),
    which every cache of its samplers is allocated from (`StepModel.cache_spec`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class KVCache:
    keys: torch.Tensor  # [N, B, G, C + 1, D]; the last slot takes dummy writes (rows that commit
    # fewer tokens than the step's commit slots, padding rows and slots of a static step)
    values: torch.Tensor  # [N, B, G, C + 1, D]
    lengths: torch.Tensor  # [B] long: entries held by each row
    length: int = 0
    """Host-side bound, read without a device sync: no row has an entry at slot `length` or beyond
    (attention masks each row's unused tail). Each step raises it by the step's commit slots; a
    caller that knows lengths.max() (the sampler) may lower it."""
    ragged: bool = False
    """Set once rows may differ in length; until then an eager step needs no key mask, and its
    staged commits already sit at every row's end."""
    attention_impl: str = "sdpa"
    """Step attention: a name with a kernel step in core.step_attention.STEP_IMPLS ('te', 'flash_attn')
    runs that kernel over the cache with per-row lengths; any other name, masked SDPA. Models
    pass their attention_impl, 'auto' resolved for their device and dtype."""
    _layout: StepLayout | None = field(default=None, repr=False)
    """The step in flight (set by `plan`, or by layer 0 from the model's arguments)."""
    _mask: torch.Tensor | None = field(default=None, repr=False)
    """The step's dense attention mask (None on the kernel path), built by layer 0: boolean inside a
    compiled step, SDPA's additive form (0 / -inf) in an eager one."""
    _commits: list = field(default_factory=list, repr=False)
    """Each layer's commit K/V [B, G, K, D] of the step in flight, written by `advance`."""
    _views: tuple = field(default=(), repr=False)
    """(keys, values, their per-layer views): made once per buffer, not per layer and step."""

    def __post_init__(self) -> None:
        self._store_for_kernel()

    def _store_for_kernel(self) -> None:
        """Tokens-major storage for a kernel that reads only that (TOKEN_MAJOR_CACHE: Transformer
        Engine), so the kernel reads the buffer in place instead of a copy per layer and step."""
        if self.attention_impl in TOKEN_MAJOR_CACHE:
            self.keys, self.values = _token_major(self.keys), _token_major(self.values)

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device=None,
        attention_impl: str = "sdpa",
    ) -> KVCache:
        shape = (num_layers, batch_size, num_kv_heads, capacity + 1, head_dim)
        return cls(
            keys=torch.zeros(shape, dtype=dtype, device=device),
            values=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
            attention_impl=attention_impl,
        )

    @classmethod
    def of(cls, spec: CacheSpec, batch_size: int, capacity: int, attention_impl: str = "sdpa") -> KVCache:
        """A cache of `spec`'s shape for batch_size rows of `capacity` entries."""
        return cls.allocate(
            num_layers=spec.num_layers,
            batch_size=batch_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            capacity=capacity,
            dtype=spec.dtype,
            device=spec.device,
            attention_impl=attention_impl,
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[3] - 1

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    @property
    def uses_kernel(self) -> bool:
        """Whether attention runs a kernel step (lengths, no dense mask) rather than masked SDPA."""
        return self.attention_impl in STEP_IMPLS

    @property
    def layout(self) -> StepLayout | None:
        """The planned layout of the step about to run (None: the model's tokens are padded)."""
        return self._layout

    def plan(self, layout: StepLayout) -> None:
        """The layout of the next step; without one, a step's tokens are its padded view."""
        if layout.rows != self.rows:
            raise ValueError(f"a step layout of {layout.rows} rows for a cache of {self.rows}")
        self._layout = layout

    def _start_step(
        self, q_BHTD: torch.Tensor, num_tokens: int, num_commit: int, commit_valid: torch.Tensor | None
    ) -> StepLayout:
        if self._layout is None:
            self._layout = StepLayout.padded(q_BHTD.shape[0], num_commit, num_tokens - num_commit, commit_valid)
        layout = self._layout
        if layout.span is None:  # (a static step reads no host-side length: its graph would depend on it)
            span = self.length
            if span + layout.num_commit + layout.num_query > self.capacity:
                raise ValueError(
                    f"KV cache capacity {self.capacity} exceeded ({span} cached + "
                    f"{layout.num_commit + layout.num_query} step tokens); allocate a larger capacity"
                )
        elif layout.span > self.capacity:
            raise ValueError(f"a static step's span {layout.span} exceeds the KV cache capacity {self.capacity}")
        else:
            span = layout.span
        self._mask = None
        if not self.uses_kernel:  # the kernel takes lengths (self.lengths, counts): no dense mask
            counts = layout.commit_count
            keyed = self.ragged or layout.span is not None  # a static span reaches past some rows' ends
            self._mask = step_attention_mask(
                layout.rows,
                layout.num_commit,
                layout.num_query,
                span,
                cache_mask=torch.arange(span, device=self.lengths.device) < self.lengths[:, None] if keyed else None,
                commit_mask=None
                if counts is None
                else torch.arange(layout.num_commit, device=counts.device) < counts[:, None],
                device=self.lengths.device,
            )
            if not torch.compiler.is_compiling():  # SDPA's own bool-to-float conversion, once a step, not per layer
                self._mask = torch.zeros(
                    self._mask.shape, dtype=self.keys.dtype, device=self._mask.device
                ).masked_fill_(~self._mask, float("-inf"))
        return layout

    def _staged_in_place(self, layout: StepLayout) -> bool:
        """Whether an eager step's commits already sit at every row's end (no row pads its commits)."""
        return layout.span is None and not self.ragged and layout.commit_count is None

    def attend(
        self,
        layer: int,
        q_BHTD: torch.Tensor,
        k_BGTD: torch.Tensor,
        v_BGTD: torch.Tensor,
        *,
        num_commit: int,
        commit_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer's step tokens, in the model's layout (sampling/step_layout.py `plan`:
        B rows of K commit and Q query slots, packed or padded).

        An eager step stages its K/V in the slots behind `length` and attends the cache in place; a
        static step (a fixed `span`, compiled by sampling/step_compiler.py) writes nothing during the
        forward and attends the first `span` slots with its own K/V appended, because a compiled
        graph that mutates its inputs copies them. On the kernel path the cache part is the first
        `span` slots with each row's real entries a prefix of lengths[b], and the step's commits a
        prefix of the layout's commit counts.
        """
        layout = self._start_step(q_BHTD, k_BGTD.shape[2], num_commit, commit_valid) if layer == 0 else self._layout
        q, k, v = layout.to_padded(q_BHTD), layout.to_padded(k_BGTD), layout.to_padded(v_BGTD)
        keys, values = self._layer(layer)
        if layout.span is None:  # eager: stage the step behind every row's entries, attend in place
            start, num_tokens = self.length, k.shape[2]
            keys[:, :, start : start + num_tokens] = k
            values[:, :, start : start + num_tokens] = v
            staged_k, staged_v = keys[:, :, : start + num_tokens], values[:, :, : start + num_tokens]
        else:  # static: read only
            staged_k = torch.cat([keys[:, :, : layout.span], k], 2)
            staged_v = torch.cat([values[:, :, : layout.span], v], 2)
        if self._mask is None:  # the kernel: the whole buffer, each row's entries by its length
            # (capacity and dummy slot included, so its shapes stay the same from step to step:
            # cuDNN builds a graph per new shape)
            out = set_causal_step_attention(
                q,
                k,
                v,
                keys,
                values,
                num_commit=layout.num_commit,
                impl=self.attention_impl,
                cache_len=self.lengths,
                commit_len=layout.commit_count,
            )
        else:
            out = staged_step_attention(q, staged_k, staged_v, self._mask)
        if not self._staged_in_place(layout):
            self._commits.append((k[:, :, : layout.num_commit], v[:, :, : layout.num_commit]))
        return layout.to_model(out)

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values [B, G, C + 1, D]."""
        if torch.compiler.is_compiling():
            return self.keys[layer], self.values[layer]
        if not self._views or self._views[0] is not self.keys or self._views[1] is not self.values:
            layers = range(self.keys.shape[0])  # (select's views, unlike unbind's, may be written in place)
            self._views = (self.keys, self.values, [self.keys[i] for i in layers], [self.values[i] for i in layers])
        return self._views[2][layer], self._views[3][layer]

    @torch._disable_dynamo  # torch.compiler.disable, importing dynamo on the first call, not on ours (2 s)
    def advance(self) -> None:
        """Write the step's commits after each row's entries and make them visible.

        Outside any compiled graph: a compiled step hands its commits over as outputs.
        """
        layout, commits = self._layout, self._commits
        num_commit, device, counts = layout.num_commit, self.lengths.device, layout.commit_count
        if num_commit and not self._staged_in_place(layout):
            slot = torch.arange(num_commit, device=device)
            target = self.lengths[:, None] + slot
            if counts is not None:  # a row's commits past its count are dummies: to the dummy slot
                target = torch.where(slot < counts[:, None], target, self.capacity)
            for store, new in ((self.keys, [k for k, _ in commits]), (self.values, [v for _, v in commits])):
                new = torch.stack(new)  # [N, B, G, K, D]
                store.scatter_(3, target[None, :, None, :, None].expand_as(new), new)
        self.lengths += num_commit if counts is None else counts
        self.length += num_commit
        self.ragged = self.ragged or layout.commit_count is not None
        self.reset_step()

    def reset_step(self) -> None:
        """Forget a step that did not run to `advance`."""
        self._layout, self._mask, self._commits = None, None, []

    def select_rows(self, index: torch.Tensor, rows: int | None = None) -> KVCache:
        """A cache holding only the rows `index` (a copy), then empty rows up to `rows`: how the
        sampler retires finished rows."""
        pad = (rows or len(index)) - len(index)
        if pad:
            index = torch.cat([index, index.new_zeros(pad)])
        lengths = self.lengths[index]
        if pad:
            lengths[len(index) - pad :] = 0
        return KVCache(
            keys=self.keys[:, index],
            values=self.values[:, index],
            lengths=lengths,
            length=self.length,
            ragged=self.ragged or (pad > 0 and self.length > 0),
            attention_impl=self.attention_impl,
        )

    def with_rows(self, count: int) -> KVCache:
        """This cache plus `count` empty rows at the end (a copy): how rows join a running batch."""

        def grow(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(t.shape[0], count, *t.shape[2:])], 1)

        return KVCache(
            keys=grow(self.keys),
            values=grow(self.values),
            lengths=torch.cat([self.lengths, self.lengths.new_zeros(count)]),
            length=self.length,
            ragged=self.ragged or (count > 0 and self.length > 0),
            attention_impl=self.attention_impl,
        )

    def with_capacity(self, capacity: int) -> KVCache:
        """This cache with at least `capacity` slots per row (a copy when it must grow)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return self

        def grow(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(*t.shape[:3], extra, t.shape[4])], 3)

        return KVCache(
            keys=grow(self.keys),
            values=grow(self.values),
            lengths=self.lengths,
            length=self.length,
            ragged=self.ragged,
            attention_impl=self.attention_impl,
        )

    def drop(self, start_B: torch.Tensor, count_B: torch.Tensor) -> None:
        """Remove entries [start, start + count) of each row, shifting its later entries left.

        One gather over the whole cache; the sampler calls it rarely (it drops in chunks).
        """
        slot = torch.arange(self.keys.shape[3], device=self.lengths.device)
        source_BC = slot + torch.where(slot >= start_B[:, None], count_B[:, None], 0)
        index = source_BC.clamp(max=self.capacity)[None, :, None, :, None].expand_as(self.keys)
        self.keys = self.keys.gather(3, index)
        self.values = self.values.gather(3, index)
        self._store_for_kernel()
        self.lengths = self.lengths - count_B
        self.ragged = True
