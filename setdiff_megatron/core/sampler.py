"""The cached any-order set sampler (docs/method.md, "Decoding") as a continuous-batching engine.

Each step is ONE forward pass: it commits the tokens the previous step decoded to the KV cache
(clean tokens, causal among themselves in position order) and scores the current window's MASK
queries against cache + commits (commit-in-next-forward). Every query is scored as the next
rank after everything committed, so a step's logits equal a from-scratch training forward whose
clean prefix is the commit order. `decoding.py` turns the logits into the set decoded, under each
row's own `DecodingConfig`.

Requests: a prompt is a list of token ids in which MASK tokens mark spans to infill; the sampler
appends max_new_tokens MASKs (the generated tail). Every visible token, left AND right of the
spans, is prefilled first, causally in position order (the reference's
cache_full_infill_context); prefix-only caching, which ignores the right context, is not offered.

Continuous batching: requests join and leave between steps. A joining row's prefill is a step of
commits only (its own forward, shared with the other rows' decode steps), in chunks of
`prefill_chunk` tokens when set; its queries start at the next step, as alone. Finished rows
retire at once (compacted out by one index select) and waiting requests take their place, so a
long job keeps its batch full. A step holds, per row, K commit slots then Q query slots (K, Q:
maxima over the rows); a row with fewer pads with dummies (commit_valid False; dummy queries
point at a scratch column). The model computes over those slots as they stand when no row pads,
over the real ones only, packed, when rows differ, or at a bucket's static shapes when a decode
step runs compiled (core/step_layout.py, core/step_compiler.py). A row's logits depend only on its own entries, and its sampled
tokens on its own generator, so every row decodes exactly as it would alone: whatever else
shares the batch, and whenever it joined.

Memory: the KV cache is padded with per-row lengths (kv_cache.py): B rows x a capacity that holds
the longest row plus one step's staged tokens (once steps may run compiled, B and the capacity
round up to powers of two, and kv_budget counts the padding rows). `max_rows` bounds B and `kv_budget` (tokens per
layer, B x capacity) the cache; a request that does not fit waits for rows to retire, and one
that could never fit is refused when submitted. Long outputs: a row's cache never holds more
than context_len - 1 entries; when a step would overflow a row, the row keeps its sink (every
prefilled token) and drops its OLDEST generated entries, at least what the step needs and at
least 1/8 of the room after the sink. Positions keep their true values; dropped tokens stay in
the output, and from then on the row's steps no longer equal a training forward of its cache.

Stops: EOS ids and stop sequences match in the generated tail only (not in infill spans). A
match ends the completion (kept in it); positions after it are no longer decoded.

Host syncs: one small transfer per step (step sizes, each row's commit and query counts, finished
rows, each row's decoded prefix), plus the tokens of retired rows; a trace adds one per step.

Shapes: B rows, L canvas positions (+1 scratch column), K commit slots, Q query slots.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch

from setdiff_megatron.core.decoding import (
    DecodingConfig,
    RowPolicy,
    choose_tokens,
    process_logits,
    select_queries,
    stop_ends,
    window_queries,
)
from setdiff_megatron.core.kv_cache import KVCache
from setdiff_megatron.core.sample_output import BatchMetrics, RowResult, SampleOutput, StepTrace
from setdiff_megatron.core.step_compiler import StepCompiler
from setdiff_megatron.core.step_layout import StepLayout, bucket, pack

__all__ = ["StepModel", "SetSampler", "Request", "SampleOutput", "RowResult"]


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


@dataclass(frozen=True)
class Request:
    """One prompt to decode: token ids with MASK spans, the policy, and its sampling seed."""

    key: Hashable
    prompt: tuple[int, ...]
    cfg: DecodingConfig
    seed: int = 0


@dataclass(frozen=True)
class Progress:
    """A live row after a step: how much of its completion is decided as a contiguous prefix."""

    key: Hashable
    prefix: list[int]
    """Completion tokens decided from its start up to the first undecided position."""


@dataclass
class _Row:
    """Host side of one live row."""

    request: Request
    length: int
    """Prompt plus generated tail."""
    admitted: float
    prefill: list[tuple[int, int]]
    """(position, token) of visible tokens still to commit, in position order."""
    prefill_forwards: int = 0
    prefill_s: float = 0.0
    steps: int = 0
    busy_s: float = 0.0
    reported: int = 0
    """Completion tokens already reported as a decided prefix."""
    trace: list[StepTrace] | None = None


@dataclass
class _Batch:
    """Device state of the live rows; `select` compacts it when rows retire, `cat` joins rows."""

    canvas: torch.Tensor  # [B, L+1] tokens, MASK where undecoded; the last column is scratch (garbage)
    todo: torch.Tensor  # [B, L+1] positions still to decode
    tail_start: torch.Tensor  # [B] start of the generated tail, where stops may match
    stop_end: torch.Tensor  # [B] end of the leftmost stop match (the scratch column if none)
    commit_tok: torch.Tensor  # [B, K] decoded last step (or prefill), committed by the next forward
    commit_pos: torch.Tensor  # [B, K]
    commit_valid: torch.Tensor  # [B, K] a prefix of each row
    query_pos: torch.Tensor  # [B, Q] increasing; dummies point at the scratch column
    query_valid: torch.Tensor  # [B, Q]
    sink: torch.Tensor  # [B] visible tokens (never evicted)

    def select(self, keep: torch.Tensor) -> _Batch:
        return replace(self, **{f.name: getattr(self, f.name)[keep] for f in fields(self)})

    def trim(self, num_commit: int, num_query: int) -> None:
        """Drop slots no row uses (valid slots come first in every row)."""
        self.commit_tok, self.commit_pos = self.commit_tok[:, :num_commit], self.commit_pos[:, :num_commit]
        self.commit_valid = self.commit_valid[:, :num_commit]
        self.query_pos, self.query_valid = self.query_pos[:, :num_query], self.query_valid[:, :num_query]

    @property
    def scratch(self) -> int:
        return self.canvas.shape[1] - 1

    def widen(self, width: int, mask_token_id: int) -> None:
        """Make room for rows of `width` positions: the old scratch column becomes a (MASK, not to
        do) position and every pointer to it moves to the new scratch column."""
        old = self.scratch
        if width <= old:
            return
        extra = width - old
        self.canvas = torch.cat(
            [self.canvas[:, :old], self.canvas.new_full((len(self.canvas), extra + 1), mask_token_id)], 1
        )
        self.todo = torch.cat([self.todo[:, :old], self.todo.new_zeros(len(self.todo), extra + 1)], 1)
        for name in ("stop_end", "commit_pos", "query_pos"):
            value = getattr(self, name)
            setattr(self, name, torch.where(value == old, width, value))

    def cat(self, other: _Batch) -> _Batch:
        def pad(a: torch.Tensor, b: torch.Tensor, value) -> tuple[torch.Tensor, torch.Tensor]:
            n = max(a.shape[1], b.shape[1])
            return tuple(torch.cat([t, t.new_full((len(t), n - t.shape[1]), value)], 1) for t in (a, b))

        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a.dim() == 2 and f.name not in ("canvas", "todo"):
                fill = {"commit_pos": self.scratch, "query_pos": self.scratch}.get(
                    f.name, False if a.dtype == torch.bool else 0
                )
                a, b = pad(a, b, fill)
            out[f.name] = torch.cat([a, b])
        return _Batch(**out)


def _pad_rows(t: torch.Tensor, count: int, value) -> torch.Tensor:
    """`t` [B, ...] with `count` more rows of `value` (padding rows of a bucket)."""
    return torch.cat([t, t.new_full((count, *t.shape[1:]), value)]) if count else t


def _device_of(model) -> torch.device:
    """Where a StepModel's weights live (the CPU for a model without parameters)."""
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return first.device if first is not None else torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SetSampler:
    """Samples from a set diffusion model through `StepModel`, as a continuous-batching engine.

    context_len is the longest sequence a query may see (cache + commits + itself), normally
    the model's max_seq_len. `max_rows` and `kv_budget` (cache slots per layer, rows x
    capacity) bound a step's batch; `prefill_chunk` caps the tokens a row prefills per step.
    `static` admits requests only into an empty batch, which then runs until its last row ends
    (static batching, the baseline continuous batching is measured against). `compile` runs
    decode steps at bucketed static shapes through core/step_compiler.py ('off', 'auto': once a
    bucket has paid for its compile, 'on'); `compiler` shares one between engines. Use `generate`
    for a list of prompts, or `submit` / `cancel` / `step` to serve requests as they come (serving/).
    """

    def __init__(
        self,
        model: StepModel,
        *,
        mask_token_id: int,
        context_len: int,
        max_rows: int | None = None,
        kv_budget: int | None = None,
        prefill_chunk: int | None = None,
        trace: bool = False,
        static: bool = False,
        compile: str = "off",
        compiler: StepCompiler | None = None,
    ):
        if context_len < 2:
            raise ValueError(f"context_len must be >= 2 (one cached token and one query); got {context_len}")
        for name, value in (("max_rows", max_rows), ("kv_budget", kv_budget), ("prefill_chunk", prefill_chunk)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None; got {value}")
        self.model, self.mask_token_id, self.context_len = model, mask_token_id, context_len
        self.max_rows, self.kv_budget, self.prefill_chunk, self.trace = max_rows, kv_budget, prefill_chunk, trace
        self.static = static
        self.compiler = compiler if compiler is not None else StepCompiler(model, compile, _device_of(model))
        self.waiting: list[Request] = []
        self.rows: list[_Row] = []
        self.batch: _Batch | None = None
        self.cache: KVCache | None = None
        self.policy: RowPolicy | None = None
        self.generators: list[torch.Generator | None] = []
        self.metrics = BatchMetrics()
        self._cancelled: set[Hashable] = set()
        self._queries: torch.Tensor | None = None
        self._firsts: list[int] = []
        self._num_queries: list[int] = []
        """Valid query slots of each live row for its next step (host copy)."""
        self._num_commits: list[int] = []
        """Valid commit slots of each live row for its next step (host copy)."""

    # ----------------------------------------------------------------------------------------
    # requests

    def request_problem(self, prompt: Sequence[int], cfg: DecodingConfig) -> str | None:
        """Why `prompt` cannot be decoded under `cfg` (to follow the prompt's name), or None."""
        mask = self.mask_token_id
        if any(int(t) < 0 for t in prompt):
            return "must hold token ids >= 0"
        for seq in (*((t,) for t in cfg.eos_token_ids), *cfg.stop_sequences):
            if mask in seq:
                return f"has stop sequences or eos_token_ids containing the MASK token {mask}: {seq}"
        num_masked = sum(int(t) == mask for t in prompt) + cfg.max_new_tokens
        visible = len(prompt) + cfg.max_new_tokens - num_masked
        if num_masked == 0:
            return "has nothing to decode: no MASK token and max_new_tokens=0"
        if visible + min(num_masked, cfg.window) > self.context_len - 1:
            return (
                f"is longer than the context: its {visible} visible tokens plus one window "
                f"({min(num_masked, cfg.window)}) must be <= context_len - 1 = {self.context_len - 1}"
            )
        if (
            self.kv_budget is not None
            and self._reserve(len(prompt) + cfg.max_new_tokens, visible, cfg) > self.kv_budget
        ):
            return f"needs more KV cache than the whole budget of {self.kv_budget} slots"
        return None

    @property
    def load(self) -> dict[str, int]:
        """Live rows and waiting requests, for schedulers and metrics."""
        return {"running": len(self.rows), "waiting": len(self.waiting)}

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the batch at a step boundary once it fits."""
        problem = self.request_problem(request.prompt, request.cfg)
        if problem:
            raise ValueError(f"request {request.key!r} {problem}")
        self.waiting.append(request)

    def cancel(self, key: Hashable) -> None:
        """Drop a waiting request now, or a live row at the next step (finish_reason 'cancelled')."""
        before = len(self.waiting)
        self.waiting = [r for r in self.waiting if r.key != key]
        if len(self.waiting) == before:
            self._cancelled.add(key)

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    # ----------------------------------------------------------------------------------------
    # the batch API

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        cfg: DecodingConfig = DecodingConfig(),
        *,
        batch_size: int | None = None,
        trace: bool = False,
    ) -> SampleOutput:
        """Decode every prompt's MASK spans and max_new_tokens tail, with at most batch_size rows
        at a time (rows join as others finish). Prompt i samples with seed cfg.seed + i."""
        if len(prompts) == 0:
            raise ValueError("prompts must hold at least one prompt (a list of token ids); got none")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None (all prompts in one batch); got {batch_size}")
        for i, prompt in enumerate(prompts):
            problem = self.request_problem(prompt, cfg)
            if problem:
                raise ValueError(f"prompts[{i}] {problem}")
        engine = SetSampler(
            self.model,
            mask_token_id=self.mask_token_id,
            context_len=self.context_len,
            max_rows=batch_size or len(prompts),
            kv_budget=self.kv_budget,
            prefill_chunk=self.prefill_chunk,
            trace=trace,
            compiler=self.compiler,
        )
        for i, prompt in enumerate(prompts):
            engine.submit(Request(key=i, prompt=tuple(int(t) for t in prompt), cfg=cfg, seed=cfg.seed + i))
        results: list[RowResult | None] = [None] * len(prompts)
        start = time.perf_counter()
        while not engine.idle:
            for key, row in engine.step():
                results[key] = row
        metrics = engine.metrics
        metrics.total_s = time.perf_counter() - start
        metrics.num_rows = len(results)
        metrics.num_tokens = sum(r.num_decoded for r in results)
        metrics.row_steps = sum(r.steps for r in results)
        return SampleOutput(results, metrics)

    def warm_up(self, cfg: DecodingConfig, prompt_len: int, progress=None) -> float:
        """Compile, ahead of traffic, the decode buckets a full batch of `prompt_len`-token prompts
        decoded under `cfg` runs through (a server's start-up); returns the seconds it took.
        Other shapes compile when they come, as the compile mode says."""
        if not self.compiler.enabled:
            return 0.0
        token = 1 if self.mask_token_id == 0 else 0
        prompts = [[token] * prompt_len] * (self.max_rows or 1)
        mode, self.compiler.mode, self.compiler.progress = self.compiler.mode, "on", progress
        start = time.perf_counter()
        try:
            self.generate(
                prompts,
                replace(cfg, eos_token_ids=(), stop_sequences=(), max_new_tokens=max(cfg.max_new_tokens, 1)),
                batch_size=self.max_rows,
            )
        finally:
            self.compiler.mode, self.compiler.progress = mode, None
        return time.perf_counter() - start

    # ----------------------------------------------------------------------------------------
    # admission

    def _reserve(self, length: int, visible: int, cfg: DecodingConfig) -> int:
        prefill = visible if self.prefill_chunk is None else min(visible, self.prefill_chunk)
        return min(length, self.context_len - 1) + max(prefill, cfg.window) + cfg.window

    @property
    def _bucketed(self) -> bool:
        """Whether the cache keeps a bucket's rows and capacity: once a decode step may run compiled."""
        return self.compiler.enabled and (self.compiler.mode == "on" or bool(self.compiler.compiled))

    def _capacity_for(self, rows: list[_Row]) -> int:
        needed = max(self._reserve(r.length, len(r.prefill), r.request.cfg) for r in rows)
        if self._bucketed and self._within_budget(self._cache_rows(len(rows)), bucket(needed)):
            return bucket(needed)  # compiled graphs: few capacities
        return needed

    def _cache_rows(self, rows: int) -> int:
        """Rows the cache holds for `rows` live ones: padding rows count in kv_budget too."""
        return bucket(rows) if self._bucketed else rows

    def _within_budget(self, rows: int, capacity: int) -> bool:
        return self.kv_budget is None or rows * capacity <= self.kv_budget

    def _new_row(self, request: Request) -> _Row:
        tokens = list(request.prompt) + [self.mask_token_id] * request.cfg.max_new_tokens
        visible = [(p, t) for p, t in enumerate(tokens) if t != self.mask_token_id]
        return _Row(
            request=request,
            length=len(tokens),
            admitted=time.perf_counter(),
            prefill=visible,
            trace=[] if self.trace else None,
        )

    def _admit(self) -> None:
        """Move waiting requests that fit into the batch (in arrival order; the first that does not
        fit stops admission, so requests are served in order)."""
        if self.static and self.rows:
            return
        joining: list[_Row] = []
        while self.waiting:
            row = self._new_row(self.waiting[0])
            self.rows.append(row)  # counted by _fits for the next one
            if not self._fits_after(row):
                self.rows.pop()
                break
            self.waiting.pop(0)
            joining.append(row)
        if not joining:
            return
        if self.cache is None:
            self.cache = self.model.new_cache(self._cache_rows(len(joining)), self._capacity_for(joining))
        device = self.cache.keys.device
        mask = self.mask_token_id
        width = max(r.length for r in joining)
        canvas = torch.full((len(joining), width + 1), mask, dtype=torch.long, device=device)
        for i, r in enumerate(joining):
            canvas[i, : r.length - r.request.cfg.max_new_tokens] = torch.tensor(r.request.prompt, dtype=torch.long)
        pos_L = torch.arange(width + 1, device=device)
        lengths = torch.tensor([r.length for r in joining], device=device)
        todo = (canvas == mask) & (pos_L < lengths[:, None])
        tail = torch.tensor([r.length - r.request.cfg.max_new_tokens for r in joining], device=device)
        empty = torch.zeros(len(joining), 0, dtype=torch.long, device=device)
        policy = RowPolicy.of([r.request.cfg for r in joining], device=device)
        new = _Batch(
            canvas=canvas,
            todo=todo,
            tail_start=tail,
            stop_end=torch.full_like(tail, width),
            commit_tok=empty,
            commit_pos=empty,
            commit_valid=empty.bool(),
            query_pos=empty,
            query_valid=empty.bool(),
            sink=torch.tensor([len(r.prefill) for r in joining], device=device),
        )
        # The first window, as alone: rows that prefill first score it at the step after their prefill.
        new.query_pos, new.query_valid = window_queries(todo, policy)
        self._num_queries += new.query_valid.sum(1).tolist()
        self._num_commits += [0] * len(joining)
        generators = [
            torch.Generator(device=device).manual_seed(r.request.seed) if r.request.cfg.temperature > 0 else None
            for r in joining
        ]
        if self.batch is None:
            self.batch, self.policy, self.generators = new, policy, generators
        else:
            width = max(width, self.batch.scratch)
            self.batch.widen(width, mask)
            new.widen(width, mask)
            self.batch, self.policy = self.batch.cat(new), self.policy.cat(policy)
            extra = self._cache_rows(len(self.rows)) - self.cache.rows  # joining rows take the empty ones
            self.cache = (self.cache.with_rows(extra) if extra > 0 else self.cache).with_capacity(
                self._capacity_for(self.rows)
            )
            self.generators += generators

    def _fits_after(self, row: _Row) -> bool:
        """Whether the batch, `row` included (already appended to self.rows), stays in bounds."""
        if self.max_rows is not None and len(self.rows) > self.max_rows:
            return False
        if self.kv_budget is None:
            return True
        # A cache never shrinks while it has rows: what a retired row (or a bucket) reserved stays.
        held = self.cache.capacity if self.cache is not None else 0
        return self._within_budget(self._cache_rows(len(self.rows)), max(held, self._capacity_for(self.rows)))

    # ----------------------------------------------------------------------------------------
    # a step

    def _prefill_commits(self) -> None:
        """Put the next prefill chunk of every prefilling row into its commit slots."""
        chunks = {}
        for i, r in enumerate(self.rows):
            if r.prefill:
                size = len(r.prefill) if self.prefill_chunk is None else self.prefill_chunk
                chunks[i], r.prefill = r.prefill[:size], r.prefill[size:]
        if not chunks:
            return
        b, device = self.batch, self.batch.canvas.device
        k = max(b.commit_tok.shape[1], max(len(c) for c in chunks.values()))
        if k > b.commit_tok.shape[1]:
            extra = k - b.commit_tok.shape[1]
            b.commit_tok = torch.cat([b.commit_tok, b.commit_tok.new_zeros(len(self.rows), extra)], 1)
            b.commit_pos = torch.cat([b.commit_pos, b.commit_pos.new_full((len(self.rows), extra), b.scratch)], 1)
            b.commit_valid = torch.cat([b.commit_valid, b.commit_valid.new_zeros(len(self.rows), extra)], 1)
        for i, chunk in chunks.items():
            pos = torch.tensor([p for p, _ in chunk], dtype=torch.long, device=device)
            b.commit_pos[i] = b.scratch
            b.commit_pos[i, : len(chunk)] = pos
            b.commit_tok[i, : len(chunk)] = torch.tensor([t for _, t in chunk], dtype=torch.long, device=device)
            b.commit_valid[i] = False
            b.commit_valid[i, : len(chunk)] = True
            self._num_commits[i] = len(chunk)
            self.rows[i].prefill_forwards += 1

    def _query_tokens(self, rows: int, width: int) -> torch.Tensor:
        if self._queries is None or self._queries.shape[0] < rows or self._queries.shape[1] < width:
            self._queries = torch.full(
                (max(rows, 1), max(width, 1)), self.mask_token_id, device=self.batch.canvas.device
            )
        return self._queries[:rows, :width]

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, RowResult]]:
        """One engine step: admit what fits, one forward, decide, retire. Returns the rows that
        finished (their keys and results); `progress()` tells how far the live ones are."""
        cancelled = self._retire_cancelled()
        self._admit()
        if not self.rows:
            return cancelled
        t0 = time.perf_counter()
        prefilling = [bool(r.prefill) for r in self.rows]
        if any(prefilling):
            self._prefill_commits()
        b, cache = self.batch, self.cache
        device = b.canvas.device
        if any(prefilling):  # rows prefilling this step score no queries yet (they start next step, as alone)
            ready = torch.tensor([not p for p in prefilling], device=device)
            query_valid = b.query_valid & ready[:, None]
        else:
            query_valid = b.query_valid
        num_commit, num_query = b.commit_tok.shape[1], b.query_pos.shape[1]
        self._evict_if_needed(num_commit)
        if cache.length + num_commit + num_query > cache.capacity:  # admission reserves this; kept as a guard
            cache = self.cache = cache.with_capacity(cache.length + num_commit + num_query + cache.capacity // 2)
        queries = [0 if p else n for p, n in zip(prefilling, self._num_queries)]
        t_model = time.perf_counter()
        logits = self._forward(query_valid, self._num_commits, queries, decoding=not any(prefilling))
        cache = self.cache  # the first compiled step of a bucket may have re-allocated it
        self.metrics.forward_s += time.perf_counter() - t_model
        self.metrics.forwards += 1
        new, tok = self._decide(logits, query_valid, queries)
        for i, r in enumerate(self.rows):
            if prefilling[i]:
                continue
            r.steps += 1
        if self.trace:
            self._record(query_valid, new, tok, prefilling)
        b.query_pos, b.query_valid = window_queries(b.todo, self.policy)
        # The one sync of the step: the next step's sizes, who finished, and each row's decided prefix.
        counts, num_queries, rows = b.commit_valid.sum(1), b.query_valid.sum(1), len(self.rows)
        first_B = torch.where(b.todo.any(1), b.todo.to(torch.uint8).argmax(1), b.stop_end.clamp(max=b.scratch) + 1)
        host = torch.cat(
            [torch.stack([counts, num_queries, cache.lengths[:rows]]).amax(1), counts, num_queries, first_B]
        ).tolist()
        num_commit, num_query, max_len = host[:3]
        self._num_commits, queries_of, self._firsts = (
            host[3 : 3 + rows],
            host[3 + rows : 3 + 2 * rows],
            host[3 + 2 * rows :],
        )
        self._num_queries = list(queries_of)
        elapsed = time.perf_counter() - t0
        if any(prefilling):
            self.metrics.prefill_s += elapsed
        for i, r in enumerate(self.rows):
            r.busy_s += elapsed / len(self.rows)
            if prefilling[i]:
                r.prefill_s += elapsed
        cache.length = max_len
        done = [i for i, n in enumerate(queries_of) if n == 0 and not self.rows[i].prefill]
        finished = self._retire(done, "auto") if done else []
        if self.rows:
            self.batch.trim(num_commit, num_query)
        return cancelled + finished

    def _forward(
        self, query_valid: torch.Tensor, commits: list[int], queries: list[int], decoding: bool
    ) -> torch.Tensor:
        """The model's step as [B, Q, V] query logits: compiled at its bucket's static shapes,
        on the padded view when no row pads, or else packed (the ragged step, step_layout.py)."""
        b, cache, rows = self.batch, self.cache, len(self.rows)
        k, q = b.commit_tok.shape[1], b.query_pos.shape[1]
        key = None
        if decoding and self.compiler.enabled:
            # Spans from 64 slots.
            capacity = bucket(cache.capacity)
            span = min(bucket(cache.length, 64), capacity)
            # Query slots: the widest window (slots still that wide after a cancel until the step trims them).
            key = (bucket(rows), bucket(k), bucket(max(q, self.policy.max_window)), span, capacity)
            if self.compiler.wants(key) and self._within_budget(key[0], capacity):
                if (cache.rows, cache.capacity) != (key[0], capacity):  # the first compiled step: bucket the cache
                    cache = self.cache = cache.select_rows(
                        torch.arange(rows, device=cache.lengths.device), key[0]
                    ).with_capacity(capacity)
                first, start = key not in self.compiler.compiled, time.perf_counter()
                logits = self._static_step(key)
                if logits is not None:
                    _synchronize(b.canvas.device)
                    if not first:
                        self.compiler.note_compiled(key, time.perf_counter() - start)
                    return logits[:rows, :q]
        start = time.perf_counter()
        query_tok = self._query_tokens(cache.rows, q)
        if cache.rows == rows and min(commits) == k and min(queries) == q:
            logits = self.model.step(
                torch.cat([b.commit_tok, query_tok], 1), torch.cat([b.commit_pos, b.query_pos], 1), cache, k
            )
        else:
            pad = cache.rows - rows
            tokens, positions, layout = pack(
                _pad_rows(b.commit_tok, pad, 0),
                _pad_rows(b.commit_pos, pad, 0),
                _pad_rows(b.commit_valid, pad, False),
                query_tok,
                _pad_rows(b.query_pos, pad, 0),
                _pad_rows(query_valid, pad, False),
                sum(commits),
                sum(queries),
            )
            cache.plan(layout)
            logits = layout.queries(self.model.step(tokens, positions, cache, layout.model_commits))[:rows]
        _synchronize(b.canvas.device)
        if key is not None:
            self.compiler.note_eager(key, time.perf_counter() - start)
        return logits

    def _static_step(self, key: tuple[int, ...]) -> torch.Tensor | None:
        """A decode step at the static shapes of `key` (rows, commit and query slots, span, cache
        capacity), compiled; padding rows and slots are dummies. None if the model could not be
        compiled."""
        rows, num_commit, num_query, span, _ = key
        b, cache = self.batch, self.cache

        def padded(t: torch.Tensor, width: int, value) -> torch.Tensor:
            t = torch.cat([t, t.new_full((len(t), width - t.shape[1]), value)], 1)
            return _pad_rows(t, rows - len(t), value)

        commit_valid = padded(b.commit_valid, num_commit, False)
        tokens = torch.cat([padded(b.commit_tok, num_commit, 0), self._query_tokens(rows, num_query)], 1)
        positions = torch.cat([padded(b.commit_pos, num_commit, 0), padded(b.query_pos, num_query, 0)], 1)
        cache.plan(StepLayout.padded(rows, num_commit, num_query, commit_valid, span=span))
        logits = self.compiler.step(key, tokens, positions, cache, num_commit)
        if logits is None:
            cache.reset_step()
        return logits

    def progress(self, keys: set[Hashable] | None = None) -> list[Progress]:
        """The live rows (of `keys`, or all) whose decided completion prefix grew since the last
        call: one host transfer of those rows' new tokens."""
        out = []
        b = self.batch
        for i, r in enumerate(self.rows):
            if keys is not None and r.request.key not in keys:
                continue
            tail = r.length - r.request.cfg.max_new_tokens
            upto = min(self._firsts[i], r.length) - tail
            if upto > r.reported:
                out.append(Progress(r.request.key, b.canvas[i, tail + r.reported : tail + upto].tolist()))
                r.reported = upto
        return out

    def _decide(
        self, logits: torch.Tensor, query_valid: torch.Tensor, num_queries: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose this step's sets, write them to the canvas and queue them for the next forward."""
        b, policy = self.batch, self.policy
        scratch = b.scratch
        processed = process_logits(logits, b.canvas[:, :scratch], policy, self.mask_token_id)
        tok, conf = choose_tokens(processed, policy, self.generators, num_queries)
        new = select_queries(conf, query_valid, policy)
        # Slots not decoded write to the scratch column, which nothing reads.
        new_pos = torch.where(new, b.query_pos, scratch)
        b.canvas.scatter_(1, new_pos, tok)
        b.todo.scatter_(1, new_pos, False)
        # Commits of the next forward: the decoded tokens, left-aligned, still in position order.
        b.commit_pos, order = new_pos.sort(1)
        b.commit_tok, b.commit_valid = tok.gather(1, order), b.commit_pos < scratch
        if policy.uses("stops"):
            b.stop_end = torch.minimum(b.stop_end, stop_ends(b.canvas, policy.stops, b.query_pos, new, b.tail_start))
            b.todo &= torch.arange(scratch + 1, device=b.todo.device) <= b.stop_end[:, None]
        return new, tok

    def _evict_if_needed(self, num_commit: int) -> None:
        """Drop the oldest generated entries of rows this step would overflow (module docstring)."""
        budget, b, cache = self.context_len - 1, self.batch, self.cache
        if cache.length + num_commit <= budget:
            return
        lengths = cache.lengths[: len(self.rows)]
        need = lengths + b.commit_valid.sum(1) - budget
        if int(need.max()) <= 0:  # the host-side bound was loose
            return
        chunk = ((budget - b.sink) // 8).clamp(min=1)
        drop = torch.where(need > 0, torch.minimum(torch.maximum(need, chunk), lengths - b.sink), 0)
        pad = cache.rows - len(self.rows)
        cache.drop(_pad_rows(b.sink, pad, 0), _pad_rows(drop, pad, 0))
        cache.length = int(cache.lengths.max())

    def _retire_cancelled(self) -> list:
        if not self._cancelled or not self.rows:
            return []
        index = [i for i, r in enumerate(self.rows) if r.request.key in self._cancelled]
        self._cancelled -= {self.rows[i].request.key for i in index}
        return self._retire(index, "cancelled") if index else []

    def _retire(self, index: list[int], reason: str) -> list[tuple[Hashable, RowResult]]:
        """Results of the rows `index`; the others stay, compacted."""
        b, mask, now = self.batch, self.mask_token_id, time.perf_counter()
        rows = torch.tensor(index, device=b.canvas.device)
        finished = []
        for i, canvas, stop_end in zip(index, b.canvas[rows].tolist(), b.stop_end[rows].tolist()):
            r = self.rows[i]
            request = list(r.request.prompt) + [mask] * r.request.cfg.max_new_tokens
            cut = min(r.length, stop_end + 1)
            why = reason if reason != "auto" else ("stop" if stop_end < r.length else "length")
            finished.append(
                (
                    r.request.key,
                    RowResult(
                        tokens=canvas[:cut],
                        prompt_len=len(r.request.prompt),
                        num_decoded=request[:cut].count(mask),
                        finish_reason=why,
                        steps=r.steps,
                        nfe=r.steps + r.prefill_forwards,
                        seconds=now - r.admitted,
                        prefill_s=r.prefill_s,
                        busy_s=r.busy_s,
                        trace=r.trace,
                    ),
                )
            )
        keep = [i for i in range(len(self.rows)) if i not in set(index)]
        self.rows = [self.rows[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        self._num_queries = [self._num_queries[i] for i in keep]
        self._num_commits = [self._num_commits[i] for i in keep]
        self._firsts = [self._firsts[i] for i in keep] if len(self._firsts) == len(keep) + len(index) else []
        if not keep:
            self.batch = self.cache = self.policy = None
        else:
            keep_t = torch.tensor(keep, device=b.canvas.device)
            self.batch, self.cache = b.select(keep_t), self.cache.select_rows(keep_t, self._cache_rows(len(keep)))
            self.policy = self.policy.select(keep_t, keep)
        return finished

    def _record(self, query_valid, new, tok, prefilling) -> None:
        b = self.batch
        for i, (qp, qv, nw, tk) in enumerate(
            zip(b.query_pos.tolist(), query_valid.tolist(), new.tolist(), tok.tolist())
        ):
            if not prefilling[i]:
                self.rows[i].trace.append(
                    StepTrace(
                        queried=[p for p, v in zip(qp, qv) if v], decoded=[(p, t) for p, n, t in zip(qp, nw, tk) if n]
                    )
                )
