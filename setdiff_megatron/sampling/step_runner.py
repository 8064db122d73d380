"""One forward of a sampling step on the model, in the layout that suits the step's rows.

The model computes over the step's slots as they stand when no row pads (padded), over the real
ones only, packed, when rows differ (the ragged step), or at a bucket's static shapes when a
decode step runs compiled (sampling/step_layout.py, sampling/step_compiler.py). A bucket is (rows,
commit slots, query slots, cache span, capacity), powers of two; a compiled step first
re-allocates a cache of other rows or capacity at its bucket's. Padding rows and slots are
dummies, so in every layout a row's logits depend only on its own entries.

`StepModel` is all the sampler needs of a model body (torch, megatron, Hugging Face export).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from setdiff_megatron.sampling.batch_state import BatchState, pad_rows
from setdiff_megatron.sampling.cache_budget import CacheBudget
from setdiff_megatron.sampling.kv_cache import KVCache
from setdiff_megatron.sampling.step_compiler import StepCompiler
from setdiff_megatron.sampling.step_layout import StepLayout, bucket, pack

__all__ = ["StepModel", "StepRunner", "device_of"]


class StepModel(Protocol):
    """What the sampler needs from a model body (torch, megatron, Hugging Face export)."""

    def step(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        num_commit: int,
        commit_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Commit the first num_commit tokens [B, T] (or, packed, [1, N]: the layout planned on the
        cache says), return the other queries' logits [B, T - num_commit, V] ([1, N - num_commit, V])."""

    def new_cache(self, batch_size: int, capacity: int) -> KVCache: ...


def device_of(model) -> torch.device:
    """Where a StepModel's weights live (the CPU for a model without parameters)."""
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return first.device if first is not None else torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepRunner:
    """Runs the model's step for the sampler: compiled at a bucket's shapes when the compiler
    wants that bucket and it fits kv_budget, else eagerly, padded or packed; times both for
    `auto` compiling."""

    def __init__(self, model: StepModel, compiler: StepCompiler, cache_budget: CacheBudget, mask_token_id: int):
        self.model, self.compiler, self.cache_budget, self.mask_token_id = model, compiler, cache_budget, mask_token_id
        self._queries: torch.Tensor | None = None

    def forward(
        self,
        batch: BatchState,
        cache: KVCache,
        query_valid: torch.Tensor,
        commits: list[int],
        queries: list[int],
        decoding: bool,
        max_window: int,
    ) -> tuple[torch.Tensor, KVCache]:
        """The step's [B, Q, V] query logits, and the cache it ran on (the first compiled step of
        a bucket re-allocates it). `commits` and `queries`: each row's valid slots; `decoding`:
        no row prefills (only decode steps compile); `max_window`: the batch's widest window."""
        b, rows = batch, len(commits)
        k, q = b.commit_tok.shape[1], b.query_pos.shape[1]
        key = None
        if decoding and self.compiler.enabled:
            # Spans from 64 slots.
            capacity = bucket(cache.capacity)
            span = min(bucket(cache.length, 64), capacity)
            # Query slots: the widest window (slots still that wide after a cancel until the step trims them).
            key = (bucket(rows), bucket(k), bucket(max(q, max_window)), span, capacity)
            if self.compiler.wants(key) and self.cache_budget.within_budget(key[0], capacity):
                if (cache.rows, cache.capacity) != (key[0], capacity):  # the first compiled step: bucket the cache
                    cache = cache.select_rows(torch.arange(rows, device=cache.lengths.device), key[0]).with_capacity(
                        capacity
                    )
                first, start = key not in self.compiler.compiled, time.perf_counter()
                logits = self._static_step(key, b, cache)
                if logits is not None:
                    _synchronize(b.canvas.device)
                    if not first:
                        self.compiler.note_compiled(key, time.perf_counter() - start)
                    return logits[:rows, :q], cache
        start = time.perf_counter()
        query_tok = self._query_tokens(cache.rows, q, b.canvas.device)
        if cache.rows == rows and min(commits) == k and min(queries) == q:
            logits = self.model.step(
                torch.cat([b.commit_tok, query_tok], 1), torch.cat([b.commit_pos, b.query_pos], 1), cache, k
            )
        else:
            pad = cache.rows - rows
            tokens, positions, layout = pack(
                pad_rows(b.commit_tok, pad, 0),
                pad_rows(b.commit_pos, pad, 0),
                pad_rows(b.commit_valid, pad, False),
                query_tok,
                pad_rows(b.query_pos, pad, 0),
                pad_rows(query_valid, pad, False),
                sum(commits),
                sum(queries),
            )
            cache.plan(layout)
            logits = layout.queries(self.model.step(tokens, positions, cache, layout.model_commits))[:rows]
        _synchronize(b.canvas.device)
        if key is not None:
            self.compiler.note_eager(key, time.perf_counter() - start)
        return logits, cache

    def _static_step(self, key: tuple[int, ...], b: BatchState, cache: KVCache) -> torch.Tensor | None:
        """A decode step at the static shapes of `key` (rows, commit and query slots, span, cache
        capacity), compiled; padding rows and slots are dummies. None if the model could not be
        compiled."""
        rows, num_commit, num_query, span, _ = key

        def padded(t: torch.Tensor, width: int, value) -> torch.Tensor:
            t = torch.cat([t, t.new_full((len(t), width - t.shape[1]), value)], 1)
            return pad_rows(t, rows - len(t), value)

        commit_valid = padded(b.commit_valid, num_commit, False)
        tokens = torch.cat(
            [padded(b.commit_tok, num_commit, 0), self._query_tokens(rows, num_query, b.canvas.device)], 1
        )
        positions = torch.cat([padded(b.commit_pos, num_commit, 0), padded(b.query_pos, num_query, 0)], 1)
        cache.plan(StepLayout.padded(rows, num_commit, num_query, commit_valid, span=span))
        logits = self.compiler.step(key, tokens, positions, cache, num_commit)
        if logits is None:
            cache.reset_step()
        return logits

    def _query_tokens(self, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """MASK tokens [rows, width] for the query slots, from one buffer grown as needed."""
        if self._queries is None or self._queries.shape[0] < rows or self._queries.shape[1] < width:
            self._queries = torch.full((max(rows, 1), max(width, 1)), self.mask_token_id, device=device)
        return self._queries[:rows, :width]
