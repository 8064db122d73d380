"""The engine API every decoder serves: `Sampler`, the request queue and its checks.

A sampler is a continuous-batching engine: `submit` queues a request (refused at once if it can
never be decoded), `cancel` drops one, `step` admits what fits, runs one forward and returns the
rows that finished, `progress` tells how far the live ones are, and `generate` decodes a list of
prompts with those. The set sampler (sampling/sampler.py) and the masked-diffusion baselines'
block decoders (sampling/masked_sampler.py) implement only what differs: the request rules,
admission, the step and the retirement of their rows. Every entry point (sample, eval, lm-eval, serve,
the Hugging Face export) drives either through this API (sampling/samplers.py builds the one a
model family needs).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sample_output import BatchMetrics, Progress, RowResult, SampleOutput
from setdiff_megatron.sampling.sample_request import Request, check_bounds

__all__ = ["Sampler"]


class Sampler(ABC):
    """A continuous-batching decoder over a model body's `step` (sampling/step_runner.py StepModel).

    context_len is the longest sequence a query may see, normally the model's max_seq_len;
    `max_rows` bounds a step's batch (None: every request that fits); `trace` records each row's
    steps. Requests wait in `waiting` in arrival order; `rows` are the live ones."""

    def __init__(self, model, *, mask_token_id: int, context_len: int, max_rows: int | None, trace: bool):
        check_bounds(context_len, max_rows=max_rows)
        self.model, self.mask_token_id, self.context_len = model, mask_token_id, context_len
        self.max_rows, self.trace = max_rows, trace
        self.waiting: list[Request] = []
        self.rows: list[Any] = []
        self.metrics = BatchMetrics()
        self._cancelled: set[Hashable] = set()

    # ----------------------------------------------------------------------------------------
    # what each decoder implements

    @abstractmethod
    def request_problem(self, prompt: Sequence[int], cfg: DecodingConfig) -> str | None:
        """Why `prompt` cannot be decoded under `cfg` (to follow the prompt's name), or None."""

    @abstractmethod
    def step(self) -> list[tuple[Hashable, RowResult]]:
        """One engine step: admit what fits, one forward, decide, retire. Returns the rows that
        finished (their keys and results); `progress()` tells how far the live ones are."""

    @abstractmethod
    def progress(self, keys: set[Hashable] | None = None) -> list[Progress]:
        """The live rows (of `keys`, or all) whose decided completion prefix grew since the last call."""

    @abstractmethod
    def warm_up(self, cfg: DecodingConfig, prompt_len: int, progress=None) -> float:
        """Prepare, ahead of traffic, what a full batch of `prompt_len`-token prompts decoded under
        `cfg` needs (a server's start-up); returns the seconds it took."""

    @abstractmethod
    def _fresh(self, max_rows: int, trace: bool) -> Sampler:
        """An empty engine like this one, with `max_rows` and `trace`, for `generate`."""

    # ----------------------------------------------------------------------------------------
    # requests

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
        engine = self._fresh(batch_size or len(prompts), trace)
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
