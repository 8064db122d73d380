"""The cached any-order set sampler (ALGORITHM.md 2), batched.

Each step is ONE forward pass: it commits the tokens the previous step decoded to the KV cache
(clean tokens, causal among themselves in position order) and scores the current window's MASK
queries against cache + commits (commit-in-next-forward, 2.1). Every query is scored as the next
rank after everything committed, so a step's logits equal a from-scratch training forward whose
clean prefix is the commit order. `decoding.py` turns the logits into the set decoded.

Requests: a prompt is a list of token ids in which MASK tokens mark spans to infill; the sampler
appends max_new_tokens MASKs (the generated tail). Every visible token, left AND right of the
spans, is prefilled first, causally in position order (the reference's
cache_full_infill_context); prefix-only caching, which ignores the right context, is not offered.

Batching: rows progress at their own pace. A step holds, per row, K commit slots then Q query
slots (K, Q: maxima over the rows); a row with fewer pads with dummies (commit_valid False;
dummy queries point at a scratch column and are ignored). A row's logits depend only on its own
entries, so greedy outputs and per-row NFE do not depend on the batch. Finished rows retire at
once: state and cache are compacted by one index select, so they cost no further compute and
nobody waits for them. (Keeping them as dummies would keep shapes static, but every later step
would still pay for all B rows, and shapes change every step anyway as K and Q vary.)

KV-cache layout: padded with per-row lengths (kv_cache.py), not paged. Each row appends at its
own offset, so uneven commits leave no holes; memory is B x (min(prompt + output, context) + 2W),
known up front; retiring and evicting are plain gathers. Paging pays off when requests join and
leave a long-running server, which this batch sampler is not; here a block table would only
slow every attention call.

Long outputs: a row's cache never holds more than context_len - 1 entries, so a query sees at
most context_len tokens, as in training. When a step would overflow a row, the row keeps its
sink (every prefilled token: the prompt is never evicted) and drops its OLDEST generated entries
(those right after the sink), at least what the step needs and at least 1/8 of the room after
the sink, so the O(cache) shift runs once per eighth of that room, not every step. Positions
keep their true values; dropped tokens stay in the output. Kept entries are not recomputed (their
K/V saw the dropped ones), so from the first eviction on a row's steps are no longer a training
forward of what its cache holds.

Stops: EOS ids and stop sequences match in the generated tail only (not in infill spans). A
match ends the completion (kept in it); positions after it are no longer decoded, and tokens
already decoded there stay in the cache but leave the output.

Host syncs: one small transfer per step (step sizes, finished rows), plus the tokens of retired
rows; a trace adds one per step.

Shapes: B rows, L canvas positions (+1 scratch column), K commit slots, Q query slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Protocol, Sequence

import torch

from setdiff_megatron.core.decoding import (
    DecodingConfig,
    choose_tokens,
    process_logits,
    select_queries,
    stop_ends,
    stop_table,
    window_queries,
)
from setdiff_megatron.core.kv_cache import KVCache
from setdiff_megatron.core.sample_output import BatchMetrics, RowResult, SampleOutput, StepTrace

__all__ = ["StepModel", "SetSampler", "SampleOutput", "RowResult", "StepTrace", "BatchMetrics"]


class StepModel(Protocol):
    """What the sampler needs from a model body (torch, megatron, Hugging Face export)."""

    def step(self, tokens: torch.Tensor, position_ids: torch.Tensor, cache: KVCache, num_commit: int,
             commit_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Commit the first num_commit tokens [B, T], return the other queries' logits [B, T - num_commit, V]."""

    def new_cache(self, batch_size: int, capacity: int) -> KVCache: ...


@dataclass
class _Batch:
    """Device state of the rows still decoding; `select` compacts it when rows retire."""

    canvas: torch.Tensor  # [B, L+1] tokens, MASK where undecoded; the last column is scratch (garbage)
    todo: torch.Tensor  # [B, L+1] positions still to decode
    tail_start: torch.Tensor  # [B] start of the generated tail, where stops may match
    stop_end: torch.Tensor  # [B] end of the leftmost stop match (L if none)
    sink: torch.Tensor  # [B] prefilled cache entries, never evicted
    commit_tok: torch.Tensor  # [B, K] decoded last step, committed by the next forward
    commit_pos: torch.Tensor  # [B, K]
    commit_valid: torch.Tensor  # [B, K] a prefix of each row
    query_pos: torch.Tensor  # [B, Q] increasing; dummies point at the scratch column
    query_valid: torch.Tensor  # [B, Q]

    def select(self, keep: torch.Tensor) -> "_Batch":
        return replace(self, **{f.name: getattr(self, f.name)[keep] for f in fields(self)})

    def trim(self, num_commit: int, num_query: int) -> None:
        """Drop slots no row uses (valid slots come first in every row)."""
        self.commit_tok, self.commit_pos = self.commit_tok[:, :num_commit], self.commit_pos[:, :num_commit]
        self.commit_valid = self.commit_valid[:, :num_commit]
        self.query_pos, self.query_valid = self.query_pos[:, :num_query], self.query_valid[:, :num_query]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SetSampler:
    """Samples from a set diffusion model through `StepModel`.

    context_len is the longest sequence a query may see (cache + commits + itself), normally
    the model's max_seq_len; lowering it bounds cache memory.
    """

    def __init__(self, model: StepModel, *, mask_token_id: int, context_len: int):
        if context_len < 2:
            raise ValueError(f"context_len must be >= 2 (one cached token and one query); got {context_len}")
        self.model, self.mask_token_id, self.context_len = model, mask_token_id, context_len

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], cfg: DecodingConfig = DecodingConfig(), *,
                 batch_size: int | None = None, trace: bool = False) -> SampleOutput:
        """Decode every prompt's MASK spans and max_new_tokens tail, batch_size rows at a time."""
        requests = self._requests(prompts, cfg)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None (all prompts in one batch); got {batch_size}")
        batch_size = batch_size or len(requests)
        metrics, rows = BatchMetrics(), []
        for first in range(0, len(requests), batch_size):
            # Each batch seeds its own generator: cfg.seed + index of its first prompt.
            rows += self._generate_batch(requests[first:first + batch_size], cfg, metrics, cfg.seed + first, trace)
        metrics.num_rows = len(rows)
        metrics.num_tokens = sum(r.num_decoded for r in rows)
        metrics.row_steps = sum(r.steps for r in rows)
        return SampleOutput(rows, metrics)

    # ----------------------------------------------------------------------------------------
    # setup

    def _requests(self, prompts: Sequence[Sequence[int]], cfg: DecodingConfig) -> list[list[int]]:
        if len(prompts) == 0:
            raise ValueError("prompts must hold at least one prompt (a list of token ids); got none")
        mask = self.mask_token_id
        for seq in (*((t,) for t in cfg.eos_token_ids), *cfg.stop_sequences):
            if mask in seq:
                raise ValueError(f"stop sequences and eos_token_ids must not contain the MASK token {mask}; got {seq}")
        requests = []
        for i, prompt in enumerate(prompts):
            problem = self.request_problem(prompt, cfg)
            if problem:
                raise ValueError(f"prompts[{i}] {problem}")
            requests.append([int(t) for t in prompt] + [mask] * cfg.max_new_tokens)
        return requests

    def request_problem(self, prompt: Sequence[int], cfg: DecodingConfig) -> str | None:
        """Why `prompt` cannot be decoded under `cfg` (to follow the prompt's name), or None."""
        mask = self.mask_token_id
        if any(int(t) < 0 for t in prompt):
            return "must hold token ids >= 0"
        num_masked = sum(int(t) == mask for t in prompt) + cfg.max_new_tokens
        visible = len(prompt) + cfg.max_new_tokens - num_masked
        if num_masked == 0:
            return "has nothing to decode: no MASK token and max_new_tokens=0"
        if visible + min(num_masked, cfg.window) > self.context_len - 1:
            return (f"is longer than the context: its {visible} visible tokens plus one window "
                    f"({min(num_masked, cfg.window)}) must be <= context_len - 1 = {self.context_len - 1}")
        return None

    def _new_cache(self, requests: list[list[int]], cfg: DecodingConfig) -> KVCache:
        need = min(max(len(r) for r in requests), self.context_len - 1)
        # + 2W: a step's commits and queries (at most W each) are staged behind the longest row.
        return self.model.new_cache(len(requests), need + 2 * cfg.window)

    def _prefill(self, requests: list[list[int]], cfg: DecodingConfig, cache: KVCache) -> _Batch:
        """The initial state, after one forward caching every visible token in position order."""
        device, mask = cache.keys.device, self.mask_token_id
        width = max(len(r) for r in requests)
        canvas = torch.tensor([r + [mask] * (width + 1 - len(r)) for r in requests], device=device)
        pos_L = torch.arange(width + 1, device=device)
        row_len = torch.tensor([len(r) for r in requests], device=device)
        todo = (canvas == mask) & (pos_L < row_len[:, None])
        visible = canvas != mask
        sink = visible.sum(1)
        num_visible = [len(r) - r.count(mask) for r in requests]
        if max(num_visible) > 0:
            order = torch.sort((~visible).to(torch.uint8), dim=1, stable=True).indices[:, :max(num_visible)]
            ragged = min(num_visible) < max(num_visible)
            self.model.step(canvas.gather(1, order), order, cache, max(num_visible),
                            (torch.arange(order.shape[1], device=device) < sink[:, None]) if ragged else None)
        query_pos, query_valid = window_queries(todo, cfg)
        num_query = int(query_valid.sum(1).max())
        empty = torch.zeros(len(requests), 0, dtype=torch.long, device=device)
        return _Batch(
            canvas=canvas, todo=todo, tail_start=row_len - cfg.max_new_tokens,
            stop_end=torch.full_like(row_len, width), sink=sink,
            commit_tok=empty, commit_pos=empty, commit_valid=empty.bool(),
            query_pos=query_pos[:, :num_query], query_valid=query_valid[:, :num_query],
        )

    # ----------------------------------------------------------------------------------------
    # the loop

    def _generate_batch(self, requests: list[list[int]], cfg: DecodingConfig, metrics: BatchMetrics,
                        seed: int, trace: bool) -> list[RowResult]:
        run = _Run(requests, cfg.max_new_tokens, time.perf_counter(), trace)
        cache = self._new_cache(requests, cfg)
        device, budget = cache.keys.device, self.context_len - 1
        generator = torch.Generator(device=device).manual_seed(seed)
        b = self._prefill(requests, cfg, cache)
        stops = stop_table(cfg, device)
        queries = torch.full((len(requests), cfg.window), self.mask_token_id, device=device)
        num_commit, all_commit = 0, True
        _synchronize(device)
        run.prefill_s = time.perf_counter() - run.start
        metrics.prefill_s += run.prefill_s
        metrics.forwards += int(cache.length > 0)

        while True:
            t0 = time.perf_counter()
            logits = self.model.step(
                torch.cat([b.commit_tok, queries[:len(run.ids), :b.query_pos.shape[1]]], 1),
                torch.cat([b.commit_pos, b.query_pos], 1), cache, num_commit, None if all_commit else b.commit_valid)
            _synchronize(device)
            metrics.forward_s += time.perf_counter() - t0
            metrics.forwards += 1
            new, tok = self._decide(b, logits, cfg, generator, stops)
            if trace:
                run.record(b.query_pos, b.query_valid, new, tok)
            b.query_pos, b.query_valid = window_queries(b.todo, cfg)

            # The one sync of the step: the next step's sizes, and who finished (no query left).
            # Maxima over all rows, retiring ones included, are safe bounds for the rest.
            counts, num_queries = b.commit_valid.sum(1), b.query_valid.sum(1)
            host = torch.cat([torch.stack([counts, num_queries, cache.lengths]).amax(1), counts.amin(0, keepdim=True),
                              num_queries]).tolist()
            (num_commit, num_query, max_len, min_commit), run.step = host[:4], run.step + 1
            if 0 in host[4:]:
                keep = self._retire(run, b, host[4:])
                if not keep:
                    break
                keep_t = torch.tensor(keep, device=device)
                b, cache = b.select(keep_t), cache.select_rows(keep_t)
            b.trim(num_commit, num_query)
            all_commit = min_commit == num_commit
            cache.length = max_len
            if max_len + num_commit > budget:
                self._evict(b, cache, budget)
        metrics.total_s += time.perf_counter() - run.start
        return run.results

    def _decide(self, b: _Batch, logits: torch.Tensor, cfg: DecodingConfig, generator: torch.Generator,
                stops: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose this step's set, write it to the canvas and queue it for the next forward."""
        scratch = b.canvas.shape[1] - 1
        processed = process_logits(logits, b.canvas[:, :scratch], cfg, self.mask_token_id)
        tok, conf = choose_tokens(processed, cfg.temperature, generator)
        new = select_queries(conf, b.query_valid, cfg.tokens_per_step, cfg.threshold)
        # Slots not decoded write to the scratch column, which nothing reads.
        new_pos = torch.where(new, b.query_pos, scratch)
        b.canvas.scatter_(1, new_pos, tok)
        b.todo.scatter_(1, new_pos, False)
        # Commits of the next forward: the decoded tokens, left-aligned, still in position order.
        b.commit_pos, order = new_pos.sort(1)
        b.commit_tok, b.commit_valid = tok.gather(1, order), b.commit_pos < scratch
        if stops is not None:
            b.stop_end = torch.minimum(b.stop_end, stop_ends(b.canvas, stops, b.query_pos, new, b.tail_start))
            b.todo &= torch.arange(scratch + 1, device=b.todo.device) <= b.stop_end[:, None]
        return new, tok

    def _evict(self, b: _Batch, cache: KVCache, budget: int) -> None:
        """Drop the oldest generated entries of rows the next step would overflow (module docstring)."""
        need = cache.lengths + b.commit_valid.sum(1) - budget
        if int(need.max()) <= 0:  # the host-side bound was loose
            return
        chunk = ((budget - b.sink) // 8).clamp(min=1)
        drop = torch.where(need > 0, torch.minimum(torch.maximum(need, chunk), cache.lengths - b.sink), 0)
        cache.drop(b.sink, drop)
        cache.length = int(cache.lengths.max())

    def _retire(self, run: "_Run", b: _Batch, num_queries: list[int]) -> list[int]:
        """Record the results of the rows left without queries; return the batch indices of the others."""
        index = torch.tensor([i for i, n in enumerate(num_queries) if n == 0], device=b.canvas.device)
        seconds, steps = time.perf_counter() - run.start, run.step
        mask = self.mask_token_id
        for i, canvas, stop_end in zip(index.tolist(), b.canvas[index].tolist(), b.stop_end[index].tolist()):
            request = run.requests[run.ids[i]]
            cut = min(len(request), stop_end + 1)
            run.results[run.ids[i]] = RowResult(
                tokens=canvas[:cut], prompt_len=len(request) - run.max_new_tokens,
                num_decoded=request[:cut].count(mask), finish_reason="stop" if stop_end < len(request) else "length",
                steps=steps, nfe=steps + (request.count(mask) < len(request)), seconds=seconds,
                prefill_s=run.prefill_s, trace=run.traces[run.ids[i]],
            )
        keep = [i for i, n in enumerate(num_queries) if n > 0]
        run.ids = [run.ids[i] for i in keep]
        return keep


@dataclass
class _Run:
    """Host side of one batch: the request each live row serves, and the results so far."""

    requests: list[list[int]]
    max_new_tokens: int
    start: float
    trace: bool
    prefill_s: float = 0.0
    step: int = 0
    """Decode steps so far: all rows of a batch start together, so a row's steps are this count
    when it retires."""
    ids: list[int] = field(init=False)
    results: list[RowResult | None] = field(init=False)
    traces: list[list[StepTrace] | None] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = list(range(len(self.requests)))
        self.results = [None] * len(self.requests)
        self.traces = [[] if self.trace else None for _ in self.requests]

    def record(self, query_pos, query_valid, new, tok) -> None:
        for row, qp, qv, nw, tk in zip(self.ids, query_pos.tolist(), query_valid.tolist(), new.tolist(), tok.tolist()):
            self.traces[row].append(StepTrace(
                queried=[p for p, v in zip(qp, qv) if v],
                decoded=[(p, t) for p, n, t in zip(qp, nw, tk) if n],
            ))
