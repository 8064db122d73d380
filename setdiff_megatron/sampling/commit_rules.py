"""What each row's next forward commits: its next prefill chunk, or the set it decoded this step.

Commit-in-next-forward: a token decoded from this step's query logits is written to the canvas
at once and queued as a commit; the next forward feeds it as a clean token (causal among the
commits in position order), so its K/V join the cache without a forward of its own. Which
positions a step decodes is sampling/decoding.py's choice, under each row's own `DecodingConfig`;
stops (EOS ids, stop sequences) match in the generated tail only, and a match ends the row's
completion (kept in it): positions after it are no longer decoded.
"""

from __future__ import annotations

import torch

from setdiff_megatron.sampling.batch_state import BatchState
from setdiff_megatron.sampling.decoding import RowPolicy, choose_tokens, process_logits, select_queries, stop_ends
from setdiff_megatron.sampling.row_state import RowState

__all__ = ["commit_decided", "commit_prefill"]


def commit_prefill(batch: BatchState, rows: list[RowState], prefill_chunk: int | None, num_commits: list[int]) -> None:
    """Put the next prefill chunk (`prefill_chunk` tokens, or all) of every prefilling row into
    its commit slots, widening them if needed; `num_commits` (host copy) follows."""
    chunks = {}
    for i, r in enumerate(rows):
        if r.prefill:
            size = len(r.prefill) if prefill_chunk is None else prefill_chunk
            chunks[i], r.prefill = r.prefill[:size], r.prefill[size:]
    if not chunks:
        return
    b, device = batch, batch.canvas.device
    k = max(b.commit_tok.shape[1], max(len(c) for c in chunks.values()))
    if k > b.commit_tok.shape[1]:
        extra = k - b.commit_tok.shape[1]
        b.commit_tok = torch.cat([b.commit_tok, b.commit_tok.new_zeros(len(rows), extra)], 1)
        b.commit_pos = torch.cat([b.commit_pos, b.commit_pos.new_full((len(rows), extra), b.scratch)], 1)
        b.commit_valid = torch.cat([b.commit_valid, b.commit_valid.new_zeros(len(rows), extra)], 1)
    for i, chunk in chunks.items():
        pos = torch.tensor([p for p, _ in chunk], dtype=torch.long, device=device)
        b.commit_pos[i] = b.scratch
        b.commit_pos[i, : len(chunk)] = pos
        b.commit_tok[i, : len(chunk)] = torch.tensor([t for _, t in chunk], dtype=torch.long, device=device)
        b.commit_valid[i] = False
        b.commit_valid[i, : len(chunk)] = True
        num_commits[i] = len(chunk)
        rows[i].prefill_forwards += 1


def commit_decided(
    batch: BatchState,
    logits: torch.Tensor,
    query_valid: torch.Tensor,
    num_queries: list[int],
    policy: RowPolicy,
    generators: list[torch.Generator | None],
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose this step's sets, write them to the canvas and queue them for the next forward.
    Returns which query slots decoded [B, Q], their tokens and confidences [B, Q] (each token's
    probability under the step's processed logits)."""
    b = batch
    scratch = b.scratch
    processed = process_logits(logits, b.canvas[:, :scratch], policy, mask_token_id)
    tok, conf = choose_tokens(processed, policy, generators, num_queries)
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
    return new, tok, conf
