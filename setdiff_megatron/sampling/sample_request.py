"""A request to the set sampler, and whether it can ever be decoded.

A prompt is a list of token ids in which MASK tokens mark spans to infill; the sampler appends
max_new_tokens MASKs (the generated tail). `RequestLimits` holds only what deciding a request
needs (the MASK id, the context length, the KV budget, the prefill chunk), so a front end
(serving/app.py) refuses a request with the engine's own rules and messages without building
an engine or loading a model. `reserve` is the cache a row may hold, which admission
(sampling/cache_budget.py) counts against the budget.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from setdiff_megatron.sampling.decoding import DecodingConfig

__all__ = ["Request", "RequestLimits", "check_bounds"]


@dataclass(frozen=True)
class Request:
    """One prompt to decode: token ids with MASK spans, the policy, and its sampling seed."""

    key: Hashable
    prompt: tuple[int, ...]
    cfg: DecodingConfig
    seed: int = 0

    def tokens(self, mask_token_id: int) -> list[int]:
        """The row to decode: the prompt, then the generated tail of MASKs."""
        return list(self.prompt) + [mask_token_id] * self.cfg.max_new_tokens


def check_bounds(context_len: int, **bounds: int | None) -> None:
    """Raise unless the context holds one cached token and a query and each bound is >= 1 or None."""
    if context_len < 2:
        raise ValueError(f"context_len must be >= 2 (one cached token and one query); got {context_len}")
    for name, value in bounds.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 or None; got {value}")


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against. context_len is the longest sequence a query may see
    (cache + commits + itself), normally the model's max_seq_len; kv_budget (cache slots per
    layer, rows x capacity) and prefill_chunk (tokens a row prefills per step) as the engine's."""

    mask_token_id: int
    context_len: int
    kv_budget: int | None = None
    prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        check_bounds(self.context_len, kv_budget=self.kv_budget, prefill_chunk=self.prefill_chunk)

    def reserve(self, length: int, visible: int, cfg: DecodingConfig) -> int:
        """Cache slots a row of `length` positions, `visible` of them prefilled, may hold: its
        entries (at most context_len - 1), then one step's staged commits and queries."""
        prefill = visible if self.prefill_chunk is None else min(visible, self.prefill_chunk)
        return min(length, self.context_len - 1) + max(prefill, cfg.window) + cfg.window

    def problem(self, prompt: Sequence[int], cfg: DecodingConfig) -> str | None:
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
        if self.kv_budget is not None and self.reserve(len(prompt) + cfg.max_new_tokens, visible, cfg) > self.kv_budget:
            return f"needs more KV cache than the whole budget of {self.kv_budget} slots"
        return None
