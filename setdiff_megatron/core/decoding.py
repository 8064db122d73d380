"""Token-selection policies of the set sampler: pure functions, vectorised over the batch.

One sampling step offers each row a set of query positions (the window), turns the model's
query logits into one candidate token and a confidence per query, and keeps a subset of them:
the k most confident, plus every query at or above the threshold tau (ALGORITHM.md 2.4,
`predict_and_noise`: k = 1 and tau = 1e6 there mean one token per step). The policies compose:
window W x {span, fill} x k x tau x {greedy, temperature, top-k, top-p} x repetition penalty.
AR decoding is W = 1. Stop sequences (EOS is a stop sequence of one token) are matched on token
ids around the newly decoded positions, so checking them every step costs a few small tensor
ops and no detokenisation.

Nothing here knows about the model or the cache; `sampler.py` drives these functions.

Shapes: B rows, L canvas positions (plus one scratch column), Q query slots, V vocabulary,
S stop sequences, M longest stop sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DecodingConfig",
    "window_queries",
    "process_logits",
    "choose_tokens",
    "select_queries",
    "stop_table",
    "stop_ends",
]

_NO_TOKEN = -2
"""Fills windows outside the stop region; matches no token id and no wildcard."""
_ANY_TOKEN = -1
"""Left padding of shorter stop sequences: matches anything."""


@dataclass(frozen=True, kw_only=True)
class DecodingConfig:
    """How the sampler picks tokens. Every field is checked when the config is built."""

    window: int = 16
    """W >= 1: queries are the masked positions in [leftmost masked, leftmost masked + W) (the
    reference's position span, which out-of-order decoding can shrink to one query)."""
    fill_window: bool = False
    """Offer the W leftmost masked positions instead, so every step scores W queries."""
    block_size: int | None = None
    """Block diffusion (BD3-LM) decoding: queries never pass the end of the block (positions
    [j*S, (j+1)*S), counted from the canvas start) that holds the leftmost masked position, so a
    block is finished before the next one is queried, as a block-order model was trained. None: off."""
    tokens_per_step: int = 1
    """k >= 1: the k most confident queries are decoded each step (at most the queries offered)."""
    threshold: float | None = None
    """tau in (0, 1]: also decode every query whose confidence is >= tau. None: off (the
    reference's 1e6)."""
    temperature: float = 0.0
    """0: greedy (argmax). > 0: sample from softmax(logits / temperature)."""
    top_k: int | None = None
    """Keep only the top_k >= 1 tokens of each query (None: all)."""
    top_p: float | None = None
    """Nucleus in (0, 1]: keep the most probable tokens up to cumulative mass top_p (None: all)."""
    repetition_penalty: float = 1.0
    """> 0; HF rule: logits of tokens present in the row (prompt, right context and decoded
    tokens) are divided by it where positive and multiplied where negative. 1: off."""
    eos_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token-id sequences that end a completion (matched in the generated tail only)."""
    max_new_tokens: int = 128
    """Length of the generated tail after each prompt, >= 0 (0: infill the prompt's masks only)."""
    seed: int = 0
    """Seeds the torch.Generator of sampled decoding; greedy decoding draws nothing."""

    def __post_init__(self) -> None:
        checks = [
            ("window", self.window, self.window >= 1, ">= 1"),
            ("tokens_per_step", self.tokens_per_step, self.tokens_per_step >= 1, ">= 1"),
            ("block_size", self.block_size, self.block_size is None or self.block_size >= 1, ">= 1, or None for off"),
            ("threshold", self.threshold, self.threshold is None or 0 < self.threshold <= 1,
             "in (0, 1], or None for off"),
            ("temperature", self.temperature, self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("top_k", self.top_k, self.top_k is None or self.top_k >= 1, ">= 1, or None for off"),
            ("top_p", self.top_p, self.top_p is None or 0 < self.top_p <= 1, "in (0, 1], or None for off"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0 (1 = off)"),
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 0, ">= 0"),
            ("eos_token_ids", self.eos_token_ids, all(t >= 0 for t in self.eos_token_ids), "token ids >= 0"),
            ("stop_sequences", self.stop_sequences,
             all(len(s) >= 1 and all(t >= 0 for t in s) for s in self.stop_sequences),
             "non-empty sequences of token ids >= 0"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}; got {value!r}")


def window_queries(todo_BL: torch.Tensor, cfg: DecodingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions [B, Q] in increasing order and their validity [B, Q], Q = min(W, L).

    The last canvas column is scratch (never to do); empty slots point at it, so writing a
    dummy slot's token back to the canvas touches nothing real.
    """
    scratch = todo_BL.shape[1] - 1
    pos_L = torch.arange(todo_BL.shape[1], device=todo_BL.device)
    offered = todo_BL
    if not cfg.fill_window or cfg.block_size is not None:
        first_B = todo_BL.to(torch.uint8).argmax(1)  # the first maximum: the leftmost masked position
        end_B = first_B + cfg.window if not cfg.fill_window else torch.full_like(first_B, scratch)
        if cfg.block_size is not None:
            end_B = torch.minimum(end_B, (first_B // cfg.block_size + 1) * cfg.block_size)
        offered = todo_BL & (pos_L < end_B[:, None])
    key_BL = torch.where(offered, pos_L, scratch)
    pos_BQ = key_BL.topk(min(cfg.window, todo_BL.shape[1]), dim=1, largest=False, sorted=True).values
    return pos_BQ, pos_BQ < scratch


def process_logits(logits_BQV: torch.Tensor, canvas_BL: torch.Tensor, cfg: DecodingConfig,
                   mask_token_id: int) -> torch.Tensor:
    """The logits tokens are drawn from: MASK removed, repetition penalty, temperature, top-k/p."""
    logits = logits_BQV.to(torch.promote_types(logits_BQV.dtype, torch.float32), copy=True)
    logits.narrow(-1, mask_token_id, 1).fill_(float("-inf"))
    if cfg.repetition_penalty != 1.0:
        # The canvas holds MASK at undecoded positions; MASK's logit is -inf whatever it becomes.
        seen_BV = torch.zeros(logits.shape[0], logits.shape[2], dtype=torch.bool, device=logits.device)
        seen_BV.scatter_(1, canvas_BL, True)
        penalized = torch.where(logits > 0, logits / cfg.repetition_penalty, logits * cfg.repetition_penalty)
        logits = torch.where(seen_BV[:, None, :], penalized, logits)
    if cfg.temperature > 0:
        logits = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the mass before it reaches p: the most probable token always stays.
        drop = (probs.cumsum(-1) - probs) >= cfg.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def choose_tokens(logits_BQV: torch.Tensor, temperature: float,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per query [B, Q] and its confidence: its probability under the processed logits."""
    probs = logits_BQV.softmax(-1)
    if temperature == 0:
        conf_BQ, tok_BQ = probs.max(-1)
        return tok_BQ, conf_BQ
    tok_BQ = torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(probs.shape[:2])
    return tok_BQ, probs.gather(-1, tok_BQ[..., None])[..., 0]


def select_queries(conf_BQ: torch.Tensor, valid_BQ: torch.Tensor, k: int, threshold: float | None) -> torch.Tensor:
    """[B, Q] decode mask: the k most confident valid queries, plus every one at or above tau.

    A stable sort breaks ties in confidence towards the leftmost slot, whatever the number of
    dummy slots, so the set is exactly k and does not depend on the batch.
    """
    conf = torch.where(valid_BQ, conf_BQ, -1.0)
    top_BK = conf.sort(dim=1, descending=True, stable=True).indices[:, :k]
    select = torch.zeros_like(valid_BQ).scatter_(1, top_BK, True)
    if threshold is not None:
        select |= conf >= threshold
    return select & valid_BQ


def stop_table(cfg: DecodingConfig, device=None) -> torch.Tensor | None:
    """[S, M] stop sequences (EOS ids included), right-aligned, left-padded with a wildcard."""
    seqs = [(t,) for t in cfg.eos_token_ids] + list(cfg.stop_sequences)
    if not seqs:
        return None
    width = max(len(s) for s in seqs)
    return torch.tensor([(_ANY_TOKEN,) * (width - len(s)) + tuple(s) for s in seqs], device=device)


def stop_ends(canvas_BL: torch.Tensor, stops_SM: torch.Tensor, pos_BQ: torch.Tensor, new_BQ: torch.Tensor,
              region_start_B: torch.Tensor) -> torch.Tensor:
    """[B] leftmost end position of a stop sequence completed by this step's tokens (L if none).

    Only windows that contain a newly decoded position can hold a new match, so the check is
    O(B Q M^2) whatever the canvas length. A match must lie in [region_start, scratch); the
    MASK left at undecoded positions never matches (the sampler rejects stops containing MASK).
    """
    scratch, width = canvas_BL.shape[1] - 1, stops_SM.shape[1]
    offsets_M = torch.arange(width, device=canvas_BL.device)
    ends_BQM = pos_BQ[..., None] + offsets_M
    window_BQMM = ends_BQM[..., None] - (width - 1) + offsets_M
    inside = (window_BQMM >= region_start_B[:, None, None, None]) & (window_BQMM < scratch)
    gathered = canvas_BL.gather(1, window_BQMM.clamp(0, scratch).flatten(1)).view_as(window_BQMM)
    tokens_BQMM = torch.where(inside, gathered, _NO_TOKEN)
    match_BQMS = ((tokens_BQMM[..., None, :] == stops_SM) | (stops_SM == _ANY_TOKEN)).all(-1)
    hit_BQM = match_BQMS.any(-1) & new_BQ[..., None]
    return torch.where(hit_BQM, ends_BQM, scratch).flatten(1).amin(1)
