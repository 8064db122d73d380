"""The decoder of a model family: set diffusion's cached any-order sampler (sampling/sampler.py) or
the baselines' block decoders (sampling/masked_sampler.py), behind one engine API
(sampling/engine.py `Sampler`), so an entry point builds whichever its model needs without knowing the
family."""

from __future__ import annotations

from setdiff_megatron.sampling.engine import Sampler
from setdiff_megatron.sampling.masked_sampler import FAMILIES, MaskedDiffusionSampler
from setdiff_megatron.sampling.sampler import SetSampler

__all__ = ["MODEL_FAMILIES", "sampler_for"]

MODEL_FAMILIES = ("set_diffusion", *FAMILIES)


def sampler_for(
    family: str,
    model,
    *,
    mask_token_id: int,
    context_len: int,
    max_rows: int | None = None,
    **options,
) -> Sampler:
    """The engine that decodes `family`'s model. `options` are set diffusion's (kv_budget,
    prefill_chunk, static, compile, trace); the baselines decode eagerly over a cache of the
    whole context per row and take only `trace`, and refuse a KV budget or prefill chunk."""
    if family == "set_diffusion":
        return SetSampler(model, mask_token_id=mask_token_id, context_len=context_len, max_rows=max_rows, **options)
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(MODEL_FAMILIES)}; got {family!r}")
    unsupported = sorted(k for k in ("kv_budget", "prefill_chunk") if options.get(k) is not None)
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)}: set diffusion's sampler options; the {family} decoder has none")
    return MaskedDiffusionSampler(
        model,
        family=family,
        mask_token_id=mask_token_id,
        context_len=context_len,
        max_rows=max_rows,
        trace=options.get("trace", False),
    )
