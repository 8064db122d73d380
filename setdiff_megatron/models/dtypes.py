"""The precision names recipes and command lines use, and their torch dtypes: one table, so a
name means the same dtype in training, sampling, export and import."""

from __future__ import annotations

import torch

from setdiff_megatron.errors import UserError

__all__ = ["DTYPES", "dtype_named", "name_of"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_named(name: str, option: str = "--dtype", allowed: tuple[str, ...] = tuple(DTYPES)) -> torch.dtype:
    if name not in allowed:
        raise UserError(f"{option} must be one of {', '.join(allowed)}; got {name!r}")
    return DTYPES[name]


def name_of(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)
