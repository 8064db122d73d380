"""Where this machine keeps what any run may reuse: the compile costs the sampler has measured
(sampling/step_compiler.py) and the built-in corpora it has built (data/builtin.py)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "machine_cache_dir"]

CACHE_ENV = "SETDIFF_CACHE_DIR"


def machine_cache_dir() -> Path:
    """$SETDIFF_CACHE_DIR, default ~/.cache/setdiff_megatron."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "setdiff_megatron")
