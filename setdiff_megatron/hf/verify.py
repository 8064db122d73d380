"""The logit comparisons every conversion ends with, on a fixed batch.

  query logits   two streams in a sampled (staggered) order: what set diffusion trains and
                 samples with; compares two bodies of our own family
  clean logits   the clean stream under the left-to-right order, through the output layer: what
                 an AR model computes, so an imported Llama/Qwen must reproduce its source's logits

Comparisons run in float32 on the CPU. A conversion that changes precision compares against the
source rounded to the target precision (that isolates the weight mapping from rounding) and
reports how far rounding itself moved the logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from setdiff_megatron.core.orders import Staggered
from setdiff_megatron.core.streams import TwoStreamBatch, sample_two_stream_batch
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer

__all__ = [
    "DEFAULT_TOLERANCE",
    "Comparison",
    "fixed_batch",
    "fixed_tokens",
    "torch_model",
    "query_logits",
    "clean_stream",
    "compare",
]

DEFAULT_TOLERANCE = 1e-4
"""Largest |logit difference| --check accepts: float32 reassociation is ~1e-6 on these batches;
a wrong mapping moves logits by O(1)."""
BATCH, LENGTH, SEED = 2, 32, 1234


@dataclass
class Comparison:
    what: str
    max_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance

    def line(self) -> str:
        verdict = "ok" if self.ok else f"MISMATCH (tolerance {self.tolerance:.1e})"
        return f"{self.what}: max |logit difference| {self.max_diff:.3e}  {verdict}"


def fixed_tokens(cfg: ModelConfig, *, max_token: int | None = None) -> torch.Tensor:
    """[BATCH, L] token ids below max_token (default: the vocabulary), never MASK."""
    gen = torch.Generator().manual_seed(SEED)
    high = min(max_token or cfg.vocab_size, cfg.vocab_size)
    tokens = torch.randint(0, high - 1, (BATCH, min(LENGTH, cfg.max_seq_len)), generator=gen)
    return tokens + (tokens >= cfg.mask_token_id).long() if cfg.mask_token_id < high else tokens


def fixed_batch(cfg: ModelConfig) -> TwoStreamBatch:
    """Two streams in a staggered order (d=4) of `fixed_tokens`."""
    gen = torch.Generator().manual_seed(SEED + 1)
    return sample_two_stream_batch(fixed_tokens(cfg), Staggered(d=4), mask_token_id=cfg.mask_token_id, generator=gen)


def torch_model(
    cfg: ModelConfig, state_dict: dict[str, torch.Tensor], *, round_to: torch.dtype | None = None
) -> SetDiffusionTransformer:
    """A float32 torch model with these weights (first rounded to `round_to`, if given)."""
    model = SetDiffusionTransformer(cfg.replace(attention_impl="sdpa"))
    state = {k: (v.to(round_to) if round_to is not None else v).float() for k, v in state_dict.items()}
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def query_logits(model, batch: TwoStreamBatch) -> torch.Tensor:
    return model(batch.clean_tokens, batch.query_tokens, batch.position_ids).float()


@torch.no_grad()
def family_logits(model, batch: TwoStreamBatch, family: str, block_size: int | None) -> torch.Tensor:
    """The logits an export's forward computes from these inputs for a model of `family`
    (hf/hf_model.py): set diffusion's two streams, BD3-LM's with its blocks as groups, MDLM's one
    bidirectional stream of the clean tokens."""
    if family == "mdlm":
        groups = torch.zeros_like(batch.clean_tokens)
        return model(None, batch.clean_tokens, batch.position_ids, groups=groups).float()
    groups = batch.position_ids // block_size if family == "bd3lm" else None
    return model(batch.clean_tokens, batch.query_tokens, batch.position_ids, groups=groups).float()


@torch.no_grad()
def clean_stream(model: SetDiffusionTransformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-norm hidden states, logits) of the clean stream under the left-to-right order:
    position r sees tokens 0..r, exactly an AR model's computation."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    hidden = model.hidden_states(
        tokens, torch.full_like(tokens, model.config.mask_token_id), positions, clean_rows=True
    )
    clean = hidden[:, : tokens.shape[1]]
    return model.norm(clean).float(), model.output_logits(clean).float()


@contextlib.contextmanager
def quiet_transformers(transformers) -> Iterator[None]:
    """No progress bars from transformers while a check loads a model (stderr keeps the one-line
    error of a failed check)."""
    logging = transformers.utils.logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def compare(what: str, a: torch.Tensor, b: torch.Tensor, tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    if a.shape != b.shape:
        raise ValueError(f"{what}: logits of shape {tuple(a.shape)} and {tuple(b.shape)}")
    return Comparison(what, float((a.float() - b.float()).abs().max()), tolerance)
