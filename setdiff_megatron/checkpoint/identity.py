"""A model's identity: the ModelConfig fields that say what was learnt, written once.

A checkpoint records it (train_state.json `model`); a resume compares it with the run's model,
and readers rebuild the ModelConfig from it. `attention_impl` and `init_std` change how a model
computes or starts, not what it has learnt, so they are left out: a checkpoint trained with one
attention kernel resumes or samples with another.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from setdiff_megatron.models.config import ModelConfig

__all__ = ["model_identity", "identity_difference", "config_from_identity"]

NOT_MODEL_IDENTITY = ("attention_impl", "init_std")


def model_identity(config: ModelConfig) -> dict:
    return {k: v for k, v in asdict(config).items() if k not in NOT_MODEL_IDENTITY}


def identity_difference(saved: dict, wanted: dict) -> str | None:
    """How a saved identity differs from `wanted` ('field X there, Y here; ...'), or None. A field
    added to ModelConfig after a checkpoint was saved holds its default there."""
    saved = {f.name: f.default for f in fields(ModelConfig) if f.name in wanted} | saved
    diffs = [f"{k} {saved.get(k)} there, {v} here" for k, v in wanted.items() if saved.get(k) != v]
    return "; ".join(diffs) or None


def config_from_identity(
    identity: dict, *, attention_impl: str = "fused", init_std: float | None = None
) -> ModelConfig:
    """The ModelConfig a checkpoint's identity describes, run with `attention_impl`."""
    known = {f.name for f in fields(ModelConfig)}
    extra = {"attention_impl": attention_impl} | ({"init_std": init_std} if init_std is not None else {})
    return ModelConfig(**{k: v for k, v in (identity | extra).items() if k in known}).resolved()
