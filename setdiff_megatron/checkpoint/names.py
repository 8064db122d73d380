"""The names of a run directory: where checkpoints live and what their files are called.

<run>/checkpoints/step_00000300/     a published checkpoint (docs/training.md, "Training and checkpoints")
<run>/checkpoints/step_00000300.tmp  a save in progress, or one a crash interrupted
<run>/checkpoints/step_00000150.aside-<time>   a checkpoint moved aside, never deleted
<run>/checkpoints/latest             the name of the newest published checkpoint
"""

from __future__ import annotations

import re
import time
from pathlib import Path

__all__ = [
    "CHECKPOINTS",
    "LATEST",
    "MANIFEST",
    "TRAIN_STATE",
    "RNG_FILE",
    "TOKENIZER_DIR",
    "DEEPSPEED_TAG",
    "step_name",
    "step_of",
    "checkpoints_root",
    "find_checkpoints",
    "is_checkpoint_path",
    "aside_name",
]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
TOKENIZER_DIR = "tokenizer"
DEEPSPEED_TAG = "deepspeed"
"""The DeepSpeed engine's folder in a checkpoint (its `tag`): step_00000300/deepspeed/."""
RNG_FILE = "rank_{rank:05d}.pt"
_PUBLISHED = re.compile(r"step_(\d{8})")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a published checkpoint directory is named after, or None for any other name."""
    match = _PUBLISHED.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoints_root(path: str | Path) -> Path:
    """The checkpoints/ folder of a run directory (or `path` itself when it is that folder)."""
    path = Path(path)
    return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path


def find_checkpoints(root: Path) -> list[Path]:
    """Published checkpoint directories under `root`, newest first (valid or not)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None), reverse=True)


def is_checkpoint_path(path: str | Path) -> bool:
    """A step directory, a run's checkpoints/ folder or a run directory (of either engine)."""
    path = Path(path)
    return (path / TRAIN_STATE).is_file() or (path / LATEST).is_file() or (path / CHECKPOINTS / LATEST).is_file()


def aside_name(path: Path, why: str) -> Path:
    """A free name beside `path` for moving it out of the way: `<name>.<why>-<UTC time>`."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    candidate = path.with_name(f"{path.name}.{why}-{stamp}")
    n = 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{why}-{stamp}-{n}")
    return candidate
