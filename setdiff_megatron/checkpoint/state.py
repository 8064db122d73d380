"""`train_state.json`: what a checkpoint holds besides its weights, with one reader and one writer.

The file is one JSON object: `Progress`'s fields at the top level, then every other field of
`TrainState` under its own name (each described where it is declared), None values left out.
`read_train_state` turns a missing or damaged file into a one-line UserError.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from setdiff_megatron.checkpoint.names import TRAIN_STATE
from setdiff_megatron.errors import UserError

__all__ = ["Progress", "TrainState", "read_train_state", "write_train_state"]


@dataclass
class Progress:
    """Where training stands; the loop advances it and a resume restores it."""

    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


@dataclass
class TrainState:
    """A checkpoint's train_state.json."""

    progress: Progress
    """step, consumed_samples, skipped_steps: where training stands (top-level keys)."""
    scheduler: dict[str, Any]
    """The LR scheduler's state_dict (megatron-core's OptimizerParamScheduler)."""
    layout: dict[str, Any]
    """The parallel layout it was saved from; the DeepSpeed engine adds its own keys."""
    model: dict[str, Any]
    """The model's identity (identity.py): what a resume and a reader must agree on."""
    tokenizer: dict[str, int]
    """Vocabulary size and MASK id."""
    run_id: str | None = None
    """The training run that wrote it: a resume continues that run, a fresh start is a new one;
    only a run's own checkpoints are ever replaced or removed by it."""
    weights_only: bool = False
    """True for checkpoints with no optimizer state (imports, conversions)."""
    source: dict[str, Any] | None = field(default=None)
    """Where converted weights came from (conversions only)."""
    ema: dict[str, float] | None = None
    """{"decay": d} when the checkpoint also holds an average of the weights (train.ema_decay),
    which evaluation, sampling and export then read."""

    def to_json(self) -> dict[str, Any]:
        out = {**asdict(self.progress), **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "progress"}}
        return {k: v for k, v in out.items() if v is not None}


_REQUIRED = ("step", "consumed_samples", "scheduler", "layout", "tokenizer")


def read_train_state(step_dir: str | Path) -> TrainState:
    """The train_state.json of a checkpoint directory, or a UserError naming the file and the damage."""
    path = Path(step_dir) / TRAIN_STATE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is damaged ({exc})") from None
    if not isinstance(raw, dict) or (missing := [k for k in _REQUIRED if k not in raw]):
        raise UserError(f"{path} is damaged (no {', '.join(missing) if isinstance(raw, dict) else 'JSON object'})")
    if raw.get("model") is None:
        raise UserError(f"{path} records no model config (saved by an older setdiff); retrain or re-save it")
    progress = Progress(raw["step"], raw["consumed_samples"], raw.get("skipped_steps", 0))
    return TrainState(
        progress=progress,
        scheduler=raw["scheduler"],
        layout=raw["layout"],
        model=raw["model"],
        tokenizer=raw["tokenizer"],
        run_id=raw.get("run_id"),
        weights_only=raw.get("weights_only", False),
        source=raw.get("source"),
        ema=raw.get("ema"),
    )


def write_train_state(step_dir: str | Path, state: TrainState) -> None:
    (Path(step_dir) / TRAIN_STATE).write_text(json.dumps(state.to_json(), indent=1), encoding="utf-8")
