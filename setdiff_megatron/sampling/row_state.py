"""The host side of one live row of the sampler: its request, the visible tokens it has still to
prefill, its counters and trace, and the RowResult it ends with. Kept on the host so a step
reads them without a device sync; the row's tensors are in sampling/batch_state.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from setdiff_megatron.sampling.sample_output import RowResult, StepTrace
from setdiff_megatron.sampling.sample_request import Request

__all__ = ["RowState", "record_traces"]


@dataclass
class RowState:
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

    @classmethod
    def admit(cls, request: Request, mask_token_id: int, trace: bool) -> RowState:
        """A row for `request`, admitted now: every visible token, left and right of its spans, to prefill."""
        tokens = request.tokens(mask_token_id)
        visible = [(p, t) for p, t in enumerate(tokens) if t != mask_token_id]
        return cls(
            request=request,
            length=len(tokens),
            admitted=time.perf_counter(),
            prefill=visible,
            trace=[] if trace else None,
        )

    @property
    def tail_start(self) -> int:
        """Where the generated tail starts (the prompt's length)."""
        return self.length - self.request.cfg.max_new_tokens

    def result(self, canvas: list[int], stop_end: int, reason: str, now: float, mask_token_id: int) -> RowResult:
        """The row's result from its canvas, cut after the stop match ending at `stop_end`;
        reason 'auto' is 'stop' when there is a match in the row, else 'length'."""
        cut = min(self.length, stop_end + 1)
        return RowResult(
            tokens=canvas[:cut],
            prompt_len=len(self.request.prompt),
            num_decoded=self.request.tokens(mask_token_id)[:cut].count(mask_token_id),
            finish_reason=reason if reason != "auto" else ("stop" if stop_end < self.length else "length"),
            steps=self.steps,
            nfe=self.steps + self.prefill_forwards,
            seconds=now - self.admitted,
            prefill_s=self.prefill_s,
            busy_s=self.busy_s,
            trace=self.trace,
        )


def record_traces(
    rows: list[RowState],
    query_pos: torch.Tensor,
    query_valid: torch.Tensor,
    new: torch.Tensor,
    tok: torch.Tensor,
    conf: torch.Tensor,
    prefilling: list[bool],
) -> None:
    """Append this step's queries, decoded tokens and their log-probabilities to the trace of
    every row that decoded."""
    logp = conf.double().log().tolist()
    for i, (qp, qv, nw, tk) in enumerate(zip(query_pos.tolist(), query_valid.tolist(), new.tolist(), tok.tolist())):
        if not prefilling[i]:
            rows[i].trace.append(
                StepTrace(
                    queried=[p for p, v in zip(qp, qv) if v],
                    decoded=[(p, t) for p, n, t in zip(qp, nw, tk) if n],
                    logprobs=[lp for n, lp in zip(nw, logp[i]) if n],
                )
            )
