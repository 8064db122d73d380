"""How big the sampler's KV cache is, and what a row loses when it outgrows the context.

The cache (sampling/kv_cache.py) holds B rows x a capacity for the longest row plus one step's staged
tokens (`RequestLimits.reserve`), both rounded up to powers of two (`bucket`) once decode steps may
run compiled; kv_budget counts the padding rows. A request that does not fit waits for rows to
retire; one that could never fit is refused when submitted (`RequestLimits.problem`). A row that
outgrows the context loses its oldest generated entries (`evict`).
"""

from __future__ import annotations

import torch

from setdiff_megatron.sampling.batch_state import BatchState, pad_rows
from setdiff_megatron.sampling.kv_cache import KVCache
from setdiff_megatron.sampling.row_state import RowState
from setdiff_megatron.sampling.sample_request import RequestLimits
from setdiff_megatron.sampling.step_compiler import StepCompiler
from setdiff_megatron.sampling.step_layout import bucket

__all__ = ["CacheBudget"]


class CacheBudget:
    """The cache's rows and capacity for a batch of rows, within the limits; bucketed once decode
    steps may run compiled (the compiler says when)."""

    def __init__(self, limits: RequestLimits, compiler: StepCompiler):
        self.limits, self.compiler = limits, compiler

    @property
    def bucketed(self) -> bool:
        """Whether the cache keeps a bucket's rows and capacity: once a decode step may run compiled."""
        return self.compiler.enabled and (self.compiler.mode == "on" or bool(self.compiler.compiled))

    def rows_for(self, rows: int) -> int:
        """Rows the cache holds for `rows` live ones: padding rows count in kv_budget too."""
        return bucket(rows) if self.bucketed else rows

    def within_budget(self, rows: int, capacity: int) -> bool:
        return self.limits.kv_budget is None or rows * capacity <= self.limits.kv_budget

    def capacity_for(self, rows: list[RowState]) -> int:
        needed = max(self.limits.reserve(r.length, len(r.prefill), r.request.cfg) for r in rows)
        if self.bucketed and self.within_budget(self.rows_for(len(rows)), bucket(needed)):
            return bucket(needed)  # compiled graphs: few capacities
        return needed

    def fits(self, rows: list[RowState], cache: KVCache | None) -> bool:
        """Whether a cache for `rows` (`cache` held now, or None) stays within kv_budget."""
        if self.limits.kv_budget is None:
            return True
        # A cache never shrinks while it has rows: what a retired row (or a bucket) reserved stays.
        held = cache.capacity if cache is not None else 0
        return self.within_budget(self.rows_for(len(rows)), max(held, self.capacity_for(rows)))

    def grown(self, cache: KVCache, rows: list[RowState]) -> KVCache:
        """`cache` with room for `rows`, the joining ones taking the empty rows."""
        extra = self.rows_for(len(rows)) - cache.rows
        return (cache.with_rows(extra) if extra > 0 else cache).with_capacity(self.capacity_for(rows))

    def evict(self, cache: KVCache, batch: BatchState, num_commit: int) -> None:
        """Drop the oldest generated entries of rows this step would overflow.

        A row's cache never holds more than context_len - 1 entries: the row keeps its sink (every
        prefilled token) and drops at least what the step needs and at least 1/8 of the room after
        the sink. Positions keep their true values and dropped tokens stay in the output
        (docs/method.md, "KV cache")."""
        budget = self.limits.context_len - 1
        if cache.length + num_commit <= budget:
            return
        live = len(batch.canvas)
        lengths = cache.lengths[:live]
        need = lengths + batch.commit_valid.sum(1) - budget
        if int(need.max()) <= 0:  # the host-side bound was loose
            return
        chunk = ((budget - batch.sink) // 8).clamp(min=1)
        drop = torch.where(need > 0, torch.minimum(torch.maximum(need, chunk), lengths - batch.sink), 0)
        pad = cache.rows - live
        cache.drop(pad_rows(batch.sink, pad, 0), pad_rows(drop, pad, 0))
        cache.length = int(cache.lengths.max())
