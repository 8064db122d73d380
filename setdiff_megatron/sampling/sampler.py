"""The cached set sampler (docs/method.md, "Decoding") as a continuous-batching engine.

Each step is one forward pass that commits the tokens the previous step decided to the KV cache
and scores the current window's MASK queries against cache and commits. Requests join and leave
between steps; a row's logits depend only on its own cache entries and its sampled tokens on its
own generator, so every row decodes exactly as it would alone, whatever shares the batch and
whenever it joined. This module admits, steps and retires rows; the parts it drives are listed in
docs/architecture.md, "The sampler inside sampling/".
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from setdiff_megatron.sampling.batch_state import BatchState
from setdiff_megatron.sampling.cache_budget import CacheBudget
from setdiff_megatron.sampling.commit_rules import commit_decided, commit_prefill
from setdiff_megatron.sampling.decoding import DecodingConfig, RowPolicy, window_queries
from setdiff_megatron.sampling.engine import Sampler
from setdiff_megatron.sampling.kv_cache import KVCache
from setdiff_megatron.sampling.row_state import RowState, record_traces
from setdiff_megatron.sampling.sample_output import Progress, RowResult
from setdiff_megatron.sampling.sample_request import RequestLimits
from setdiff_megatron.sampling.step_compiler import StepCompiler
from setdiff_megatron.sampling.step_runner import StepModel, StepRunner, device_of

__all__ = ["SetSampler", "Progress"]


class SetSampler(Sampler):
    """Samples from a set diffusion model through `StepModel`, as a continuous-batching engine.

    context_len is the longest sequence a query may see (cache + commits + itself), normally
    the model's max_seq_len. `max_rows` and `kv_budget` (cache slots per layer, rows x
    capacity) bound a step's batch; `prefill_chunk` caps the tokens a row prefills per step.
    `static` admits requests only into an empty batch, which then runs until its last row ends
    (static batching, the baseline continuous batching is measured against). `compile` runs
    decode steps at bucketed static shapes through sampling/step_compiler.py ('off', 'auto': once a
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
        super().__init__(model, mask_token_id=mask_token_id, context_len=context_len, max_rows=max_rows, trace=trace)
        self.limits = RequestLimits(mask_token_id, context_len, kv_budget, prefill_chunk)
        self.kv_budget, self.prefill_chunk = kv_budget, prefill_chunk
        self.static = static
        self.compiler = compiler if compiler is not None else StepCompiler(model, compile, device_of(model))
        self.cache_budget = CacheBudget(self.limits, self.compiler)
        self.runner = StepRunner(model, self.compiler, self.cache_budget, mask_token_id)
        self.rows: list[RowState] = []
        self.batch: BatchState | None = None
        self.cache: KVCache | None = None
        self.policy: RowPolicy | None = None
        self.generators: list[torch.Generator | None] = []
        self._firsts: list[int] = []
        self._num_queries: list[int] = []
        """Valid query slots of each live row for its next step (host copy)."""
        self._num_commits: list[int] = []
        """Valid commit slots of each live row for its next step (host copy)."""

    # ----------------------------------------------------------------------------------------
    # requests

    def request_problem(self, prompt: Sequence[int], cfg: DecodingConfig) -> str | None:
        """Why `prompt` cannot be decoded under `cfg` (to follow the prompt's name), or None."""
        return self.limits.problem(prompt, cfg)

    def _fresh(self, max_rows: int, trace: bool) -> SetSampler:
        return SetSampler(
            self.model,
            mask_token_id=self.mask_token_id,
            context_len=self.context_len,
            max_rows=max_rows,
            kv_budget=self.kv_budget,
            prefill_chunk=self.prefill_chunk,
            trace=trace,
            compiler=self.compiler,
        )

    # ----------------------------------------------------------------------------------------
    # ahead of traffic

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

    def _admit(self) -> None:
        """Move waiting requests that fit into the batch (in arrival order; the first that does not
        fit stops admission, so requests are served in order)."""
        if self.static and self.rows:
            return
        joining: list[RowState] = []
        while self.waiting:
            row = RowState.admit(self.waiting[0], self.mask_token_id, self.trace)
            self.rows.append(row)  # counted in the bounds for the next one
            too_many = self.max_rows is not None and len(self.rows) > self.max_rows
            if too_many or not self.cache_budget.fits(self.rows, self.cache):
                self.rows.pop()
                break
            self.waiting.pop(0)
            joining.append(row)
        if not joining:
            return
        if self.cache is None:
            self.cache = self.model.new_cache(
                self.cache_budget.rows_for(len(joining)), self.cache_budget.capacity_for(joining)
            )
        device = self.cache.keys.device
        policy = RowPolicy.from_configs([r.request.cfg for r in joining], device=device)
        new = BatchState.joining(joining, policy, self.mask_token_id, device)
        self._num_queries += new.query_valid.sum(1).tolist()
        self._num_commits += [0] * len(joining)
        generators = [
            torch.Generator(device=device).manual_seed(r.request.seed) if r.request.cfg.temperature > 0 else None
            for r in joining
        ]
        if self.batch is None:
            self.batch, self.policy, self.generators = new, policy, generators
        else:
            self.batch, self.policy = self.batch.cat(new, self.mask_token_id), self.policy.cat(policy)
            self.cache = self.cache_budget.grown(self.cache, self.rows)
            self.generators += generators

    # ----------------------------------------------------------------------------------------
    # a step

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
            commit_prefill(self.batch, self.rows, self.prefill_chunk, self._num_commits)
        b, cache = self.batch, self.cache
        device = b.canvas.device
        if any(prefilling):  # rows prefilling this step score no queries yet (they start next step, as alone)
            ready = torch.tensor([not p for p in prefilling], device=device)
            query_valid = b.query_valid & ready[:, None]
        else:
            query_valid = b.query_valid
        num_commit, num_query = b.commit_tok.shape[1], b.query_pos.shape[1]
        self.cache_budget.evict(cache, b, num_commit)
        if cache.length + num_commit + num_query > cache.capacity:  # admission reserves this; kept as a guard
            cache = self.cache = cache.with_capacity(cache.length + num_commit + num_query + cache.capacity // 2)
        queries = [0 if p else n for p, n in zip(prefilling, self._num_queries)]
        t_model = time.perf_counter()
        logits, cache = self.runner.forward(
            b, cache, query_valid, self._num_commits, queries, not any(prefilling), self.policy.max_window
        )
        self.cache = cache  # the first compiled step of a bucket may have re-allocated it
        self.metrics.forward_s += time.perf_counter() - t_model
        self.metrics.forwards += 1
        new, tok, conf = commit_decided(
            b, logits, query_valid, queries, self.policy, self.generators, self.mask_token_id
        )
        for i, r in enumerate(self.rows):
            if prefilling[i]:
                continue
            r.steps += 1
        if self.trace:
            record_traces(self.rows, b.query_pos, query_valid, new, tok, conf, prefilling)
        b.query_pos, b.query_valid = window_queries(b.todo, self.policy)
        # The one sync of the step: the next step's sizes, who finished, and each row's decided prefix
        # (a trace adds one more per step; retiring rows copies their tokens to the host).
        (num_commit, num_query, max_len), self._num_commits, queries_of, self._firsts = b.sync(
            cache.lengths[: len(self.rows)]
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

    def progress(self, keys: set[Hashable] | None = None) -> list[Progress]:
        """The live rows (of `keys`, or all) whose decided completion prefix grew since the last
        call: one host transfer of those rows' new tokens."""
        out = []
        b = self.batch
        for i, r in enumerate(self.rows):
            if keys is not None and r.request.key not in keys:
                continue
            tail = r.tail_start
            upto = min(self._firsts[i], r.length) - tail
            if upto > r.reported:
                out.append(Progress(r.request.key, b.canvas[i, tail + r.reported : tail + upto].tolist()))
                r.reported = upto
        return out

    # ----------------------------------------------------------------------------------------
    # retirement

    def _retire_cancelled(self) -> list:
        if not self._cancelled or not self.rows:
            return []
        index = [i for i, r in enumerate(self.rows) if r.request.key in self._cancelled]
        self._cancelled -= {self.rows[i].request.key for i in index}
        return self._retire(index, "cancelled") if index else []

    def _retire(self, index: list[int], reason: str) -> list[tuple[Hashable, RowResult]]:
        """Results of the rows `index`; the others stay, compacted."""
        b, now = self.batch, time.perf_counter()
        rows = torch.tensor(index, device=b.canvas.device)
        finished = [
            (self.rows[i].request.key, self.rows[i].result(canvas, stop_end, reason, now, self.mask_token_id))
            for i, canvas, stop_end in zip(index, b.canvas[rows].tolist(), b.stop_end[rows].tolist())
        ]
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
            self.batch, self.cache = (
                b.select(keep_t),
                self.cache.select_rows(keep_t, self.cache_budget.rows_for(len(keep))),
            )
            self.policy = self.policy.select(keep_t, keep)
        return finished
