"""How one sampling step's tokens are laid out for the model, and for attention over the cache.

Attention always runs over a padded view, B rows x (K commit slots, then Q query slots); the model
sees the same padded tokens (`StepLayout.padded`) or only the real ones packed into one row [1, N]
(`pack`), and `gather` / `scatter` move activations between the two views. For compiled steps the
sampler (sampling/step_runner.py) rounds B, K, Q and the cache span up with `bucket`
(docs/sampling.md, "Step layouts").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepLayout", "bucket", "pack"]


def bucket(n: int, floor: int = 1) -> int:
    """The power of two at or above max(n, floor)."""
    return 1 << (max(n, floor, 1) - 1).bit_length()


@dataclass(frozen=True)
class StepLayout:
    """One step: the padded attention view and, when packed, the map from the model's tokens."""

    rows: int
    """B: rows of the padded view (the cache's rows)."""
    num_commit: int
    """K: commit slots per row."""
    num_query: int
    """Q: query slots per row."""
    commit_count: torch.Tensor | None
    """[B] real commits of each row (a prefix of its K slots); None: all K are real."""
    span: int | None = None
    """Cache slots attention reads; None: the cache's host-side length bound."""
    gather: torch.Tensor | None = None
    """[B * (K + Q)] the packed token of each padded slot (dummy slots: any token); None: not packed."""
    scatter: torch.Tensor | None = None
    """[N] the padded slot of each packed token: the commits', then the queries'."""
    packed_queries: int = 0
    """How many of the N packed tokens are queries (the last ones)."""

    @classmethod
    def padded(
        cls, rows: int, num_commit: int, num_query: int, commit_valid: torch.Tensor | None, span: int | None = None
    ) -> StepLayout:
        """The model sees the padded view itself; `commit_valid` [B, K] marks real commits."""
        counts = None if commit_valid is None else commit_valid.sum(1)
        return cls(rows, num_commit, num_query, counts, span)

    @property
    def model_commits(self) -> int:
        """How many of the model's tokens (per row) are commits: they come first."""
        return self.num_commit if self.gather is None else self.scatter.shape[0] - self.packed_queries

    def to_padded(self, x_BHND: torch.Tensor) -> torch.Tensor:
        """[1, H, N, D] packed (or [B, H, T, D] padded) -> [B, H, K + Q, D]."""
        if self.gather is None:
            return x_BHND
        rows, width = self.rows, self.num_commit + self.num_query
        out = x_BHND[0].index_select(1, self.gather)  # [H, B * (K + Q), D]
        return out.view(out.shape[0], rows, width, out.shape[2]).transpose(0, 1)

    def to_model(self, x_BHTD: torch.Tensor) -> torch.Tensor:
        """[B, H, K + Q, D] padded -> the model's layout ([1, H, N, D] when packed)."""
        if self.scatter is None:
            return x_BHTD
        flat = x_BHTD.transpose(0, 1).flatten(1, 2)  # [H, B * (K + Q), D]
        return flat.index_select(1, self.scatter)[None]

    def queries(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's query logits ([B, Q, V], or [1, Nq, V] packed) as [B, Q, V]."""
        if self.gather is None:
            return logits
        if self.packed_queries == 0:  # a step of prefills only
            return logits.new_zeros(self.rows, self.num_query, logits.shape[-1])
        width = self.num_commit + self.num_query
        index = self.gather.view(self.rows, width)[:, self.num_commit :] - self.model_commits
        return logits[0].index_select(0, index.clamp(min=0).flatten()).view(self.rows, self.num_query, -1)


def pack(
    commit_tok: torch.Tensor,
    commit_pos: torch.Tensor,
    commit_valid: torch.Tensor,
    query_tok: torch.Tensor,
    query_pos: torch.Tensor,
    query_valid: torch.Tensor,
    num_commits: int,
    num_queries: int,
) -> tuple[torch.Tensor, torch.Tensor, StepLayout]:
    """Tokens [1, N], positions [1, N] and the layout of the real slots of a padded step.

    commit_*/query_* are [B, K] / [B, Q] with real entries a prefix of each row; num_commits
    and num_queries are their counts (known on the host, so nothing here syncs).
    """
    rows, k = commit_valid.shape
    q = query_valid.shape[1]
    width = k + q
    slot = torch.arange(rows * width, device=commit_valid.device).view(rows, width)
    commit_slots = torch.nonzero_static(commit_valid.flatten(), size=num_commits)[:, 0]
    query_slots = torch.nonzero_static(query_valid.flatten(), size=num_queries)[:, 0]
    scatter = torch.cat([slot[:, :k].flatten()[commit_slots], slot[:, k:].flatten()[query_slots]])
    gather = torch.zeros(rows * width, dtype=torch.long, device=commit_valid.device)
    gather[scatter] = torch.arange(scatter.shape[0], device=scatter.device)
    tokens = torch.cat([commit_tok.flatten()[commit_slots], query_tok.flatten()[query_slots]])
    positions = torch.cat([commit_pos.flatten()[commit_slots], query_pos.flatten()[query_slots]])
    counts = None if num_commits == rows * k else commit_valid.sum(1)  # None: every commit slot is real
    layout = StepLayout(rows, k, q, counts, gather=gather, scatter=scatter, packed_queries=num_queries)
    return tokens[None], positions[None], layout
