"""What the set sampler returns: the rows it decoded and how fast, per row and per batch.

NFE (docs/method.md, "NFE and tokens per step") counts the forward passes a row took part in,
its prefill included when it has visible tokens; tokens per step (the reference's "parallelism
factor") excludes the prefill. Bookkeeping is everything in the decode loop outside the model's
step.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["StepTrace", "RowResult", "BatchMetrics", "SampleOutput", "Progress"]


@dataclass(frozen=True)
class StepTrace:
    queried: list[int]
    """Positions offered as queries."""
    decoded: list[tuple[int, int]]
    """(position, token) pairs decoded, in position order (the next step commits them in this order)."""
    logprobs: list[float] | None = None
    """Each decoded token's natural log-probability under the step's processed logits (its
    confidence): the terms of the trajectory's exact log-likelihood (sampling/trajectory.py)."""


@dataclass(frozen=True)
class RowResult:
    tokens: list[int]
    """The prompt with its spans filled, then the completion (cut after a stop sequence)."""
    prompt_len: int
    num_decoded: int
    """MASK positions filled in `tokens` (spans and completion)."""
    finish_reason: str
    """'stop' (an EOS or stop sequence ended the completion) or 'length'."""
    steps: int
    """Decode forwards the row took part in (its NFE without the prefill)."""
    nfe: int
    """Forward passes: steps, plus the prefill when the row has visible tokens
    (docs/method.md, "NFE and tokens per step")."""
    seconds: float
    """From the row's admission into the batch (prefill included) to its retirement."""
    prefill_s: float
    """The row's prefill steps."""
    busy_s: float = 0.0
    """The row's share of the engine's time: each step's time divided among the rows in it, so
    the shares of all rows add up to the time the engine spent (throughput per replica)."""
    trace: list[StepTrace] | None = None

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def tokens_per_step(self) -> float:
        return self.num_decoded / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.num_decoded / self.seconds


@dataclass
class BatchMetrics:
    num_rows: int = 0
    num_tokens: int = 0
    row_steps: int = 0
    """Sum over rows of their decode steps."""
    forwards: int = 0
    """Batched forward passes, prefills included."""
    prefill_s: float = 0.0
    """Time of the steps in which some row prefilled."""
    forward_s: float = 0.0
    """Time inside the model's steps."""
    total_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.total_s

    @property
    def tokens_per_step(self) -> float:
        return self.num_tokens / max(self.row_steps, 1)

    @property
    def bookkeeping_share(self) -> float:
        """Share of the sampler's time spent outside the model: admission, selection, stops,
        compaction, host syncs."""
        return (self.total_s - self.forward_s) / self.total_s


@dataclass(frozen=True)
class SampleOutput:
    rows: list[RowResult]
    """In the order of the prompts."""
    metrics: BatchMetrics


@dataclass(frozen=True)
class Progress:
    """A live row after a step: how much of its completion is decided as a contiguous prefix."""

    key: Hashable
    prefix: list[int]
    """Completion tokens decided from its start up to the first undecided position."""
