"""The host RNG states a checkpoint saves per rank, so a resumed run draws what it would have."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["host_rng_state", "set_host_rng_state"]


def host_rng_state() -> dict:
    """Python, numpy, torch and CUDA generator states, loadable with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_host_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
