"""The device state of the sampler's live rows: each row's canvas and the slots of its next step.

A step holds, per row, K commit slots then Q query slots (K, Q: maxima over the rows), each
row's valid slots first; a row with fewer pads with dummies (commit_valid False; dummy queries
point at a scratch column past the canvas, which nothing reads). Rows join by one `cat` and
leave by one index `select`, so a long job keeps its batch full without re-building it.

Shapes: B rows, L canvas positions (+1 scratch column), K commit slots, Q query slots.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from setdiff_megatron.sampling.decoding import RowPolicy, window_queries
from setdiff_megatron.sampling.row_state import RowState

__all__ = ["BatchState", "pad_rows"]


def pad_rows(t: torch.Tensor, count: int, value) -> torch.Tensor:
    """`t` [B, ...] with `count` more rows of `value` (padding rows of a bucket)."""
    return torch.cat([t, t.new_full((count, *t.shape[1:]), value)]) if count else t


@dataclass
class BatchState:
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

    @classmethod
    def joining(cls, rows: list[RowState], policy: RowPolicy, mask_token_id: int, device) -> BatchState:
        """The state of rows about to join: their canvases, nothing to commit yet, and their first
        window, as alone (rows that prefill first score it at the step after their prefill)."""
        width = max(r.length for r in rows)
        canvas = torch.full((len(rows), width + 1), mask_token_id, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            canvas[i, : r.tail_start] = torch.tensor(r.request.prompt, dtype=torch.long)
        pos_L = torch.arange(width + 1, device=device)
        lengths = torch.tensor([r.length for r in rows], device=device)
        todo = (canvas == mask_token_id) & (pos_L < lengths[:, None])
        tail = torch.tensor([r.tail_start for r in rows], device=device)
        empty = torch.zeros(len(rows), 0, dtype=torch.long, device=device)
        state = cls(
            canvas=canvas,
            todo=todo,
            tail_start=tail,
            stop_end=torch.full_like(tail, width),
            commit_tok=empty,
            commit_pos=empty,
            commit_valid=empty.bool(),
            query_pos=empty,
            query_valid=empty.bool(),
            sink=torch.tensor([len(r.prefill) for r in rows], device=device),
        )
        state.query_pos, state.query_valid = window_queries(todo, policy)
        return state

    def sync(self, cache_lengths: torch.Tensor) -> tuple[list[int], list[int], list[int], list[int]]:
        """A step's one host transfer: [commit slots, query slots, cache length] the next step needs
        (maxima over the rows of `cache_lengths` [B] and the slot counts), then each row's valid
        commits, its valid queries, and its first undecided position (past its stop match, or
        its end, when it has none left: its decided prefix ends there)."""
        counts, num_queries, rows = self.commit_valid.sum(1), self.query_valid.sum(1), len(self.canvas)
        first_B = torch.where(
            self.todo.any(1), self.todo.to(torch.uint8).argmax(1), self.stop_end.clamp(max=self.scratch) + 1
        )
        host = torch.cat(
            [torch.stack([counts, num_queries, cache_lengths]).amax(1), counts, num_queries, first_B]
        ).tolist()
        return host[:3], host[3 : 3 + rows], host[3 + rows : 3 + 2 * rows], host[3 + 2 * rows :]

    def select(self, keep: torch.Tensor) -> BatchState:
        return replace(self, **{f.name: getattr(self, f.name)[keep] for f in fields(self)})

    def trim(self, num_commit: int, num_query: int) -> None:
        """Drop slots no row uses (valid slots come first in every row)."""
        if self.commit_tok.shape[1] > num_commit:
            self.commit_tok, self.commit_pos = self.commit_tok[:, :num_commit], self.commit_pos[:, :num_commit]
            self.commit_valid = self.commit_valid[:, :num_commit]
        if self.query_pos.shape[1] > num_query:
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

    def cat(self, other: BatchState, mask_token_id: int) -> BatchState:
        """These rows, then `other`'s, both widened to the wider canvas (slots padded with dummies)."""
        width = max(self.scratch, other.scratch)
        self.widen(width, mask_token_id)
        other.widen(width, mask_token_id)

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
        return BatchState(**out)
