"""What an evaluation job records besides its scores: the hardware it ran on, summary files
written atomically, and an optional Weights & Biases run.

wandb is imported only when a job is given a project; without the package the job stops
before any work with a one-line error naming the `wandb` extra. Runs are offline by default
(`wandb sync` uploads them later), since evaluation nodes often have no network.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.errors import UserError, require

__all__ = ["hardware", "write_json", "write_jsonl", "WandbConfig", "check_wandb", "log_to_wandb"]

WANDB_MODES = ("offline", "online", "disabled")


def hardware(device: str = "auto") -> dict[str, Any]:
    """The machine of the process that merges and scores a job (its generation may have run on others)."""
    cuda = torch.cuda.is_available() and device != "cpu"
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "num_gpus": torch.cuda.device_count() if cuda else 0,
        "processes": int(os.environ.get("WORLD_SIZE", "1")),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_json(path: str | Path, payload: Any) -> None:
    """Write `payload` as JSON through a temporary file and a rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class WandbConfig:
    """Where to log (None project: nowhere)."""

    def __init__(self, project: str | None = None, mode: str = "offline", name: str | None = None):
        if mode not in WANDB_MODES:
            raise UserError(f"--wandb-mode must be one of {', '.join(WANDB_MODES)}; got {mode!r}")
        self.project, self.mode, self.name = project, mode, name


def check_wandb(cfg: WandbConfig) -> None:
    """Fail before any work when logging is asked for and wandb is missing."""
    if cfg.project is not None:
        require("wandb", "wandb", "--wandb-project (Weights & Biases logging)")


def log_to_wandb(
    cfg: WandbConfig,
    *,
    job_type: str,
    config: dict,
    summary: dict,
    rows: list[dict] | None = None,
    out_dir: str | Path | None = None,
) -> None:
    """One run per job: its settings as config, its metrics as summary, per-point rows as a table."""
    if cfg.project is None:
        return
    wandb = require("wandb", "wandb", "--wandb-project (Weights & Biases logging)")
    run = wandb.init(
        project=cfg.project,
        name=cfg.name,
        mode=cfg.mode,
        job_type=job_type,
        config=config,
        dir=str(out_dir) if out_dir is not None else None,
        reinit=True,
    )
    for step, row in enumerate(rows or []):
        run.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}, step=step)
    if rows:
        columns = sorted({k for r in rows for k, v in r.items() if isinstance(v, (str, int, float))})
        run.log({"points": wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})
    run.summary.update({k: v for k, v in summary.items() if isinstance(v, (str, int, float))})
    run.finish()
