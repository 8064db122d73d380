"""The exact log-likelihood of a decoded trajectory, in one teacher-forced forward.

`replay_batch` lays a set sampler's decode out as a two-stream batch (the prompt, then each step's
tokens in position order, the steps as groups that see one another by rank), so each token's
logits are those of the step that decided it (docs/rl.md, "The exact likelihood"); the sum of
their log-probabilities (core/loss.py token_nll, at the sampling temperature) is the trajectory's.
A decode must not have evicted cache entries (its prompt and completion fit the context).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.sampling.sample_output import RowResult

__all__ = ["replay_batch"]


def _replay_row(row: RowResult, mask_token_id: int) -> tuple[list[int], list[int], list[int], list[bool]]:
    """(tokens, positions, groups, decided) of one row in replay order."""
    if row.trace is None:
        raise ValueError("replay needs the decode's trace (sample with trace=True)")
    kept = len(row.tokens)
    prompt = [p for p in range(row.prompt_len) if p < kept and all(p != q for s in row.trace for q, _ in s.decoded)]
    tokens = [row.tokens[p] for p in prompt]
    positions, groups, decided = list(prompt), [0] * len(prompt), [False] * len(prompt)
    for step, trace in enumerate(row.trace, start=1):
        for p, t in trace.decoded:
            if p < kept:  # tokens decided past a stop sequence were cut from the completion
                tokens.append(t)
                positions.append(p)
                groups.append(step)
                decided.append(True)
    if any(t == mask_token_id for t in tokens):
        raise ValueError("a replayed trajectory holds MASK tokens: the trace does not match the tokens")
    return tokens, positions, groups, decided


def replay_batch(rows: Sequence[RowResult], mask_token_id: int, device=None) -> TwoStreamBatch:
    """The decoded `rows` as one training batch in replay order, padded at the end: targets are
    the decided tokens (the prompt's are context), loss_mask marks them, groups are the steps."""
    replays = [_replay_row(r, mask_token_id) for r in rows]
    width = max(len(t) for t, _, _, _ in replays)

    def padded(index: int, fill) -> torch.Tensor:
        return torch.tensor([r[index] + [fill] * (width - len(r[index])) for r in replays], device=device)

    tokens = padded(0, mask_token_id)
    groups = padded(2, 0)
    valid = torch.tensor([len(r[0]) for r in replays], device=device)
    # padding after the last step: its own, latest group
    groups = torch.where(torch.arange(width, device=device)[None] < valid[:, None], groups, groups.max() + 1)
    return TwoStreamBatch(
        clean_tokens=tokens,
        query_tokens=torch.full_like(tokens, mask_token_id),
        position_ids=padded(1, 0),
        targets=tokens,
        loss_mask=padded(3, False),
        valid_len=valid,
        groups=groups,
        group_within="rank",
    )
